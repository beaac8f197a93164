#!/usr/bin/env bash
# Check kvdisk against a vLLM release before widening the pin in pyproject.toml:
#   scripts/check_vllm_release.sh 0.35.0
# builds .venv-vllm-0.35.0 with vLLM's Python on a CPU torch (as scripts/setup_vllm034.sh
# does for 0.34, but from the release's own requirements: every Requires-Dist of its wheel
# except the GPU-only ones, resolved as a new user's install would, torch held at the CPU
# build) and runs the contract suite (tests/contract: vLLM's own Scheduler with kvdisk).
# A failure names the part of the connector contract the new release changed.
# About 3 minutes and 3.5 GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/check_vllm_release.sh VLLM_VERSION}
VENV=.venv-vllm-$VERSION
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip packaging
grep '^torch==' constraints-vllm034.txt > "$VENV/constraints.txt"
"$VENV/bin/pip" download -q --no-deps "vllm==$VERSION" -d "$VENV/wheel"
"$VENV/bin/python" - "$VENV" "$VERSION" <<'PY'
import glob, sys, zipfile
from packaging.requirements import Requirement

venv, version = sys.argv[1:]
gpu = {  # CUDA builds and kernels: not installable or importable without a GPU
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "apache-tvm-ffi", "tilelang", "nvtx", "fastsafetensors", "instanttensor", "quack-kernels",
    "tokenspeed-mla", "humming-kernels", "triton",
}
(wheel,) = glob.glob(f"{venv}/wheel/vllm-{version}-*.whl")
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
keep = []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    name = req.name.lower().replace("_", "-")
    if name in gpu or name.startswith(("nvidia-", "cuda-", "cutlass")):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    keep.append(str(req))
open(f"{venv}/requirements.txt", "w").write("\n".join(keep) + "\n")
print(f"vLLM {version}: {len(keep)} non-GPU requirements")
PY
pip=("$VENV/bin/pip" install -q -c "$VENV/constraints.txt")
"${pip[@]}" torch -r "$VENV/requirements.txt" xxhash zstandard prometheus-client pytest pytest-timeout
"${pip[@]}" --no-deps "vllm==$VERSION"
exec "$VENV/bin/python" -m pytest -q tests/contract -p no:cacheprovider
