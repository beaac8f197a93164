#!/usr/bin/env bash
# Create ./.venv034 (idempotent): vLLM 0.34's own Python on a CPU torch, for the contract
# suite (tests/contract) only. The official vLLM wheel is a CUDA build whose hard pins
# (torch 2.14 with CUDA libraries, flashinfer, ...) do not install or import here, so this
# venv takes vLLM's Python without its kernels:
#   * torch 2.13.0+cpu (the CPU torch of the engine venv; from this machine's wheel folder),
#   * the few requirements of vLLM 0.34 that `import vllm`, its config, scheduler and
#     structured-output backends need at import time (not its GPU ones),
#   * `vllm==0.34.0` and `xgrammar` with --no-deps,
#   * kvdisk's own requirements and pytest.
# Every version is pinned by constraints-vllm034.txt. What runs here: vLLM's Scheduler, KV
# cache manager and block pool (Python) with kvdisk as connector; no model, no kernels.
# Another release: scripts/check_vllm_release.sh VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV034:-.venv034}
VERSION=0.34.0
CONSTRAINTS=constraints-vllm034.txt
STAMP="$VENV/.kvdisk-installed"
want=$(cat "$CONSTRAINTS" scripts/setup_vllm034.sh | sha1sum | cut -d' ' -f1)-$VERSION
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip=("$VENV/bin/pip" install -q -c "$CONSTRAINTS")
"$VENV/bin/pip" install -q -U pip
"${pip[@]}" torch packaging numpy pydantic regex psutil pyzmq requests transformers \
    aiohttp pillow pybase64 cachetools cbor2 msgspec cloudpickle uvloop py-cpuinfo \
    prometheus_client llguidance einops apache-tvm-ffi \
    xxhash zstandard prometheus-client pytest pytest-timeout hypothesis
"${pip[@]}" --no-deps "vllm==$VERSION" xgrammar
VERSION=$VERSION "$VENV/bin/python" - <<'PY'
import os, vllm, torch
assert vllm.__version__ == os.environ["VERSION"], vllm.__version__
print(f"vLLM {vllm.__version__} (Python only) on torch {torch.__version__}")
PY
echo "$want" > "$STAMP"
