#!/usr/bin/env bash
# The whole suite: lint, then pytest. pytest's exit 5 ("no tests ran") is a failure too.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check . || exit 1
.venv/bin/ruff format --check . > /dev/null || { echo "ruff format would change files: run .venv/bin/ruff format ."; exit 1; }
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit "$rc"
