#!/usr/bin/env bash
# Install (first run only) and run the whole test suite, real vLLM engine included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
