"""Weights that come as pip packages' data (SmolLM2, all-MiniLM-L6-v2, Whisper tiny.en, a Piper voice): found where
the package is installed, never imported (their own code and dependencies are not the app's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_file(package: str, relative: str) -> Path | None:
    """`relative` (a file or a folder) inside the installed `package`, or None where it is not installed."""
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / relative).exists():
            return Path(location) / relative
    return None
