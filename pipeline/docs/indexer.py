"""Bringing a collection's index up to date with its folder: each file whose content hash changed is read (one
whose size and modification time are unchanged is not even hashed),
split, embedded and written (one transaction a file: `Index.replace_file`); a removed file's passages go; a file
that cannot be read is listed with why. Nothing is skipped silently: a file of a type not read here is listed as
such (hidden files and folders, dot-named, are not documents and are passed over). Progress after each file
(files, pages/s, time left); `cancel` stops between files, and the next refresh goes on from there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.docs.chunking import passages
from pipeline.docs.index import Index
from pipeline.docs.readers import Unreadable, read_document, supported
from pipeline.embed.embedder import Embedder

OVERLAP_SHARE = 0.15  # of a passage's tokens, repeated at the start of the next one
# a passage's tokens at most, whatever more the embedder reads (nomic-embed-text 2,048, Qwen3-Embedding 32,768): the
# sources share at most 1,500 tokens of the prompt, and a long passage's one vector blurs what it says
PASSAGE_TOKENS = 512


@dataclasses.dataclass
class Summary:
    """What a refresh did."""

    files: int = 0  # found in the folder
    read: int = 0  # read, split and embedded now
    unchanged: int = 0
    unreadable: int = 0
    removed: int = 0
    pages: int = 0  # of the files read now
    cancelled: bool = False

    def line(self) -> str:
        parts = [f"{self.read} read ({self.pages} pages)", f"{self.unchanged} unchanged"]
        parts += [f"{self.unreadable} could not be read"] if self.unreadable else []
        parts += [f"{self.removed} removed"] if self.removed else []
        return f"{self.files} files: " + ", ".join(parts) + (" — cancelled" if self.cancelled else "")


def content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def scan(root: Path) -> tuple[list[Path], dict[str, str]]:
    """(the files under `root` to index, {relative path: why it is listed unread} for the rest): symlinks
    followed once (a loop is named, not walked), hidden entries passed over."""
    found, listed, seen = [], {}, set()
    for folder, dirs, files in os.walk(root, followlinks=True, onerror=lambda e: listed.setdefault(
            os.path.relpath(e.filename, root), f"cannot be read ({e.strerror})")):
        real = os.path.realpath(folder)
        if real in seen:
            listed[os.path.relpath(folder, root)] = "a symlink loop (this folder is already in the collection)"
            dirs.clear()
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            path = Path(folder) / name
            relative = path.relative_to(root).as_posix()
            if not path.exists():
                listed[relative] = "a broken link (what it points to is gone)"
            elif not supported(path):
                listed[relative] = f"not a document type read here ({path.suffix or 'no extension'})"
            else:
                found.append(path)
    return found, listed


class Indexer:
    """Refreshes collections of `index` with `embedder`'s vectors; `max_tokens` per passage (the embedder's limit
    by default)."""

    def __init__(self, index: Index, embedder: Embedder, max_tokens: int | None = None):
        self.index, self.embedder = index, embedder
        self.max_tokens = min(max_tokens or PASSAGE_TOKENS, embedder.max_tokens) - embedder.overhead("document")

    def count(self, text: str) -> int:
        return self.embedder.count_tokens(text) - self.embedder.overhead()

    def refresh(self, collection: str, root: Path, progress: Callable[[str], None] = lambda line: None,
                cancel: threading.Event | None = None) -> Summary:
        """Bring `collection` (its files under `root`) up to date."""
        cid = self.index.collection(collection)
        files, listed = scan(root)
        excluded = self.index.excluded(cid)
        files = [p for p in files if p.relative_to(root).as_posix() not in excluded]
        listed = {path: why for path, why in listed.items() if path not in excluded}
        known = {row.path: row for row in self.index.files(cid)}
        summary = Summary(files=len(files) + len(listed))
        present = {p.relative_to(root).as_posix() for p in files} | set(listed)
        for gone in sorted(set(known) - present):
            self.index.remove_file(cid, gone)
            summary.removed += 1
        for relative, reason in listed.items():
            if known.get(relative) is None or known[relative].reason != reason:
                self.index.mark_unreadable(cid, relative, reason)
            summary.unreadable += 1
        started, done_pages = time.monotonic(), 0
        for n, path in enumerate(files):
            if cancel is not None and cancel.is_set():
                summary.cancelled = True
                break
            relative = path.relative_to(root).as_posix()
            pages = self._file(cid, path, relative, known.get(relative), summary)
            done_pages += pages
            elapsed = time.monotonic() - started
            left = elapsed / (n + 1) * (len(files) - n - 1)
            progress(f"{collection}: {n + 1}/{len(files)} files · {done_pages / max(elapsed, 1e-9):.1f} pages/s · "
                     f"about {_duration(left)} left · {relative}")
        if not summary.cancelled:
            self.index.mark_indexed(cid)
        return summary

    def _file(self, cid: int, path: Path, relative: str, known, summary: Summary) -> int:
        """Index one file if its content changed (one whose size and modification time are as when it was read is
        not even hashed); the pages read (0 when unchanged or unreadable)."""
        try:
            before = path.stat()
            if known is not None and known.reason is None and (known.size, known.modified) == \
                    (before.st_size, before.st_mtime_ns):
                summary.unchanged += 1
                return 0
            digest = content_hash(path)
        except OSError as e:
            self.index.mark_unreadable(cid, relative, f"cannot be read ({e.strerror or e})")
            summary.unreadable += 1
            return 0
        if known is not None and known.hash == digest and known.reason is None:
            summary.unchanged += 1
            return 0
        try:
            document = read_document(path)
            found = passages(document, self.count, self.max_tokens, int(self.max_tokens * OVERLAP_SHARE))
            vectors = self.embedder.encode([p.text for p in found], prompt="document")
            after = path.stat()
            if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or \
                    content_hash(path) != digest:
                raise Unreadable("changed while it was read: it is read again at the next refresh")
        except Unreadable as e:
            self.index.mark_unreadable(cid, relative, str(e), before.st_size)
            summary.unreadable += 1
            return 0
        self.index.replace_file(cid, relative, digest, before.st_size, document.pages, found, vectors,
                                before.st_mtime_ns)
        summary.read += 1
        summary.pages += document.pages
        return document.pages


def embed_missing(index: Index, embedder: Embedder, progress: Callable[[str], None] = lambda line: None,
                  cancel: threading.Event | None = None, batch: int = 256) -> int:
    """Give every passage without a vector one (after an embedder switch dropped them all), a batch a
    transaction; the number embedded."""
    done = 0
    while not (cancel is not None and cancel.is_set()) and (rows := index.missing_vectors(batch)):
        progress(f"embedding again with {embedder.name}: {done} passages so far")
        index.set_vectors([(pid, collection) for pid, collection, _ in rows],
                          embedder.encode([text for _, _, text in rows], prompt="document"))
        done += len(rows)
    return done


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
