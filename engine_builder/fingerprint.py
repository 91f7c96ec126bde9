"""Fingerprints of weight files: the part of an engine's key that says which weights it holds.

A fingerprint is the SHA-256 of every weight file's bytes, so any change to the weights rebuilds
their engines. Hashing a multi-gigabyte checkpoint costs seconds, so each file's digest is kept in
`fingerprints.json` beside the engines, keyed by path, size, modification time and inode: a
later launch hashes only files that changed since.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.files import atomic_write

WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")
MEMO = "fingerprints.json"


def weight_files(sources: list[Path]) -> list[Path]:
    """The files behind `sources`: files as given, folders as the weight files they hold."""
    files = []
    for source in map(Path, sources):
        if source.is_dir():
            files += sorted(p for p in source.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
        else:
            files.append(source)
    return files


def fingerprint(sources: list[Path], memo_dir: Path) -> str:
    """One digest of all weight files behind `sources` (contents only: a moved copy matches)."""
    memo_path = Path(memo_dir) / MEMO
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    total, changed = hashlib.sha256(), False
    for path in weight_files(sources):
        stat = path.resolve().stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        entry = memo.get(str(path.resolve()))
        if entry is None or entry["stamp"] != stamp:
            with open(path, "rb") as f:
                entry = {"stamp": stamp, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
            memo[str(path.resolve())], changed = entry, True
        total.update(entry["sha256"].encode())
    if changed:
        atomic_write(memo_path, json.dumps(memo, indent=1))
    return total.hexdigest()[:32]
