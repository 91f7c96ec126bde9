"""Fingerprints of weight files: the part of an engine's key that says which weights it holds.

A fingerprint is the SHA-256 of every weight file's digest (`pipeline.files.file_sha256`), so any change
to the weights rebuilds their engines. Hashing a multi-gigabyte checkpoint costs seconds, so each file's digest is kept in
`fingerprints.json` beside the engines, keyed by path, size, modification time and inode: a
later launch hashes only files that changed since.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.files import atomic_write, file_sha256

WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors", ".gguf")  # a GGUF folder links its file
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


def _stamp(path: Path) -> list[int]:
    stat = path.resolve().stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


def fingerprint(sources: list[Path], memo_dir: Path) -> str:
    """One digest of all weight files behind `sources` (contents only: a moved copy matches)."""
    memo_path = Path(memo_dir) / MEMO
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    stamps = {path: _stamp(path) for path in weight_files(sources)}
    new = [path for path, stamp in stamps.items() if memo.get(str(path.resolve()), {}).get("stamp") != stamp]
    # the files side by side, as each file's segments are (hashlib and reads release the GIL), the cores shared
    # out between them: no more threads than cores
    files = max(1, min(len(new), os.cpu_count() or 1))
    per_file = max(1, (os.cpu_count() or 1) // files)
    with tqdm(total=sum(stamps[p][0] for p in new), desc="fingerprinting weights (once per file)", unit="B",
              unit_scale=True, file=sys.stderr, disable=not new) as bar, ThreadPoolExecutor(files) as pool:
        for path, digest in zip(new, pool.map(lambda p: file_sha256(p, bar.update, per_file), new)):
            memo[str(path.resolve())] = {"stamp": stamps[path], "sha256": digest}
    total = hashlib.sha256()
    for path in stamps:
        total.update(memo[str(path.resolve())]["sha256"].encode())
    if new:
        atomic_write(memo_path, json.dumps(memo, indent=1))
    return total.hexdigest()[:32]
