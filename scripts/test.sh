#!/usr/bin/env bash
# Install (first run only) and run the whole test suite, real vLLM engine included.
# The shared-volume tests make a GlusterFS volume on this disk: GlusterFS is installed with
# apt-get on the first run (as root, or through sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install_glusterfs.sh
exec .venv/bin/python -m pytest -q "$@"
