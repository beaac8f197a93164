#!/usr/bin/env bash
# Format, lint and type checks (offline once installed; CI runs this before the tests).
#   scripts/lint.sh          check: exits 1 on a formatting, lint or type error
#   scripts/lint.sh --fix    reformat and apply ruff's safe fixes first, then check
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bin=.venv/bin
if [ "${1:-}" = "--fix" ]; then
    "$bin/ruff" format .
    "$bin/ruff" check --fix .
fi
"$bin/ruff" format --check .
"$bin/ruff" check .
"$bin/mypy"    # the files and strictness are in pyproject.toml
