#!/usr/bin/env bash
# Install (into .venv) and run the tests. On a machine without a GPU torch 2.13.0 is the CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh .venv dev > /dev/null
run() { .venv/bin/python -m pytest -q "$@" || [ $? -eq 5 ]; }  # 5: nothing selected (a path without such tests)
run -n auto --dist loadfile -m "not browser" "$@"  # on every core, a test file per worker
run -m browser "$@"  # the browser tests alone: they click and wait on a page, which two busy workers slowed past its waits
