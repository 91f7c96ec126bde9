#!/usr/bin/env bash
# Install (into .venv) and launch the app on 127.0.0.1:7860; extra arguments go to launch.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh .venv app
echo "[install] starting the app"
exec .venv/bin/python launch.py "$@"
