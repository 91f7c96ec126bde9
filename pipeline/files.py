"""Writing files and folders atomically (readers see the old version or the new one, never half of one), and
their digests, read side by side.

Everything the app writes into its cache (demo checkpoints, converted weights, keys) is read back by
later launches, possibly while another process builds it too; a crash mid-write must not leave a
truncated file behind that a later launch trusts.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def atomic_write(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    """Write `data` to `path` through a temporary file beside it (created private, then given `mode`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_folder(path: Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; on success it replaces `path` (and whatever was
    there), on an exception it is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        yield tmp
        if path.exists():  # move the old one aside first: a folder cannot be renamed over a full one
            old = Path(tempfile.mkdtemp(prefix=path.name + ".", suffix=".old", dir=path.parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


SEGMENT = 256 << 20  # a file's bytes are hashed in segments of this size, side by side
READ = 16 << 20  # per read: a caller's progress bar moves every few milliseconds


def file_sha256(path: Path, progress: Callable[[int], object] = lambda n: None, workers: int | None = None) -> str:
    """A file's digest, its segments hashed side by side: one SHA-256 stream runs at ~0.5 GB/s (29.5 s of
    a 15 GB checkpoint's first launch on an H200 machine, 2026-11-27), and hashlib and reads release the GIL.
    A file of one segment (under 256 MiB) gets its plain SHA-256, as `sha256sum` prints it; a larger one
    the SHA-256 of its segments' digests (their hex, in order) and its size. `workers`: threads at most (all
    cores by default; fewer where several files are hashed at once, each reading 16 MiB at a time)."""
    path = Path(path)
    size = path.stat().st_size
    starts = range(0, max(size, 1), SEGMENT)

    def segment(start: int) -> str:
        digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            left = min(SEGMENT, size - start)
            while left > 0 and (block := f.read(min(READ, left))):
                digest.update(block)
                progress(len(block))
                left -= len(block)
        return digest.hexdigest()

    if len(starts) == 1:
        return segment(0)
    with ThreadPoolExecutor(min(len(starts), workers or os.cpu_count() or 1)) as pool:
        digests = list(pool.map(segment, starts))
    return hashlib.sha256(f"{size}:{','.join(digests)}".encode()).hexdigest()
