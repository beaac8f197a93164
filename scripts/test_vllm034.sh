#!/usr/bin/env bash
# The contract suite (tests/contract) against vLLM 0.34's scheduler, in .venv034 (built by
# scripts/setup_vllm034.sh on the first run). The rest of the suite needs the CPU engine
# build of vLLM 0.32 (scripts/test.sh runs it, the contract suite included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm034.sh
exec .venv034/bin/python -m pytest -q tests/contract "$@"
