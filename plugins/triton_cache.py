"""What the app keeps in Triton's cache folder, beside Triton's own files (so a cleared cache clears it too).

Triton keys every kernel it caches by a hash of its own installation, `triton_key`, made once per process: it
reads all of libtriton (about 450 MB) and its Python files, 0.47 s on this workplace's CPU, and 0.4-0.6 s of a
second launch's wait for its kernels on an H200 (2026-11-30), where each kernel is then a read from the cache.
`remember_key` keeps that key with a digest of the name, size and modification time of every file it hashes
(8 ms to make): a process whose Triton files are unchanged takes the key from there, as Triton's own worker
pools hand their workers the key it made, and any change to them makes the key again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
from pathlib import Path

KEY_RECORD = "studio-triton-key.json"
_lock = threading.Lock()
_kept: list[str] = []  # the key this process took or made (once)


def folder() -> Path:
    import triton

    return Path(triton.knobs.cache.dir)


def keep(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a file not written costs a later launch time, nothing else)."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def files_digest(root: Path) -> str:
    """A digest of the relative name, size and modification time of each Python and library file under `root`
    (Triton's package: the files `triton_key` hashes are among them)."""
    stamps = []
    for where, _, names in os.walk(root):
        for name in names:
            if name.endswith((".py", ".so", ".pyd", ".dylib")):
                path = os.path.join(where, name)
                stat = os.stat(path)
                stamps.append(f"{os.path.relpath(path, root)}\0{stat.st_size}\0{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(sorted(stamps)).encode()).hexdigest()


def remember_key() -> str | None:
    """Triton's installation key for this process: the one kept in the cache folder where Triton's files are
    unchanged since it was made, else made now (Triton's `triton_key`) and kept. Every Triton module holding
    `triton_key` then returns it without hashing. None where this fails: Triton then makes it itself, as ever."""
    import triton
    import triton.runtime.cache as cache

    with _lock:
        if _kept:
            return _kept[0]
        made = cache.triton_key
        try:
            digest = f"{triton.__version__}:{files_digest(Path(triton.__file__).parent)}"
            record = folder() / KEY_RECORD
            key = _read_key(record, digest)
            if key is None:
                key = made()
                keep(record, json.dumps({"files": digest, "key": key}))
        except Exception:  # noqa: BLE001 - a speed-up only: Triton hashes its files at its first cache read
            return None
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("triton") and getattr(module, "triton_key", None) is made:
                module.triton_key = lambda: key
        _kept.append(key)
        return key


def _read_key(record: Path, digest: str) -> str | None:
    """The key kept in `record` for Triton files of this `digest`; None where there is none (or a damaged one)."""
    try:
        kept = json.loads(record.read_text())
        return kept["key"] if kept["files"] == digest and isinstance(kept["key"], str) else None
    except (OSError, ValueError, TypeError, KeyError):
        return None
