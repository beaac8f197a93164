#!/usr/bin/env bash
# Install (first run only) and serve an OpenAI-compatible API with the disk KV cache.
#   MODEL=...        a model id or path (default: a tiny random model built locally)
#   KV_DISK_DIR=...  where checkpoints live (default: ./.cache/kvdisk)
#   PORT=...         default 8000
# Extra arguments go to `vllm-kvdisk serve` (vLLM's flags and the --kv-disk-* flags).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
KV_DISK_DIR=${KV_DISK_DIR:-$PWD/.cache/kvdisk}
extra=()
if [ -z "${MODEL:-}" ]; then
    MODEL=$(.venv/bin/python -m vllm_kvdisk.testing.tinymodel "$PWD/.cache/tiny-model")
    # fp32 keeps the tiny model exact; eager mode starts in seconds on a CPU.
    extra+=(--dtype float32 --enforce-eager --max-model-len 8192)
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}  # GiB of KV cache on a CPU
fi
exec .venv/bin/vllm-kvdisk serve "$MODEL" --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" \
    --kv-disk-dir "$KV_DISK_DIR" --trace "${TRACE:-$KV_DISK_DIR/trace.log}" "${extra[@]}" "$@"
