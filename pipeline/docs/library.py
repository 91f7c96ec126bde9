"""The user's document collections as the app keeps them: a folder of theirs (read where it is) or files they
uploaded (copied into the data folder), indexed in the background, one collection after another, on a thread of
its own (chatting never waits for it), with progress for the tab and the terminal and a Cancel.

Two connections to the one index database: the indexing thread's, and one for everything else (listing,
questions, deleting), which reads a consistent snapshot while the other writes (WAL). A collection is refreshed
when it is added, when asked, when a chat picks it, at start-up (picking up what changed while the app was not
running, and resuming an indexing that a killed process left), and while the app runs when a file in its folder
changes (`watchfiles`: the system's own file notifications, nothing polls; a burst of changes is one refresh). A deleted collection can be restored for
`UNDO_S` seconds; then its passages, and the copies of its uploaded files, go for good.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import queue
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.docs.citations import CitationStream
from pipeline.docs.index import FileRow, Index
from pipeline.docs.indexer import Indexer, embed_missing
from pipeline.docs.retrieval import Source, retrieve
from pipeline.docs.vector_cache import VectorCache
from pipeline.embed.embedder import EmbedderSlot
from pipeline.embed.reranker import Reranker
from pipeline.errors import UserError
from pipeline.files import atomic_write

INDEX_FILE = "documents.sqlite3"
UPLOADS = "documents"  # in the data folder: one folder of uploaded files per collection
UNDO_S = 10
SAY_EVERY_S = 5.0  # the terminal gets an indexing's progress at most this often (and its end)
NAME = re.compile(r"^[\w][\w .,'()-]{0,59}$")
EMBED_MISSING = ""  # the job that gives passages their vectors after an embedder switch


@dataclasses.dataclass(frozen=True)
class CollectionView:
    """A collection as the tab lists it."""

    name: str
    root: Path
    uploaded: bool  # its files were uploaded (copies in the data folder), not a folder of the user's
    indexed: float | None  # when it was last brought up to date
    files: list[FileRow]
    state: str  # what its indexing is doing, or did last ("" before any)
    busy: bool  # indexing queued or running

    @property
    def pages(self) -> int:
        return sum(f.pages or 0 for f in self.files)

    @property
    def passages(self) -> int:
        return sum(f.passages for f in self.files)

    @property
    def size(self) -> int:
        return sum(f.size or 0 for f in self.files)

    @property
    def unreadable(self) -> list[FileRow]:
        return [f for f in self.files if f.reason is not None]


@dataclasses.dataclass
class Job:
    state: str = "waiting to be indexed…"
    busy: bool = True
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)


def _locked(method: Callable) -> Callable:
    """One caller at a time on the reader connection (a transaction is the connection's, not the thread's)."""
    @functools.wraps(method)
    def run(self: Library, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class Library:
    """The collections in `folder` (the app's data folder), embedded with `embedder`; `say` gets the terminal's
    lines."""

    def __init__(self, folder: Path, embedder: EmbedderSlot, say: Callable[[str], None] = lambda line: None,
                 reranker: Callable[[], Reranker] | None = None):
        """`reranker`: loads the cross-encoder that reorders what retrieval finds (on the first question)."""
        self.folder, self.embedder, self.say = Path(folder), embedder, say
        self._load_reranker, self._reranker = reranker, None
        self.uploads = self.folder / UPLOADS
        self._reader: Index | None = None
        self._vectors = VectorCache()  # the collections' vectors in memory, shared by the two connections
        self._lock = threading.RLock()  # the reader connection, and `_jobs`
        self._jobs: dict[str, Job] = {}
        self._queue: queue.Queue[str] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._watching: dict[str, threading.Event] = {}  # a folder collection's watcher, stopped by setting it
        self._key = self._link_key()

    # ---- the index -----------------------------------------------------------------------------

    def _open(self) -> Index:
        embedder = self.embedder.get()
        return Index(self.folder / INDEX_FILE, embedder.name, embedder.dim, self._vectors)

    @property
    def index(self) -> Index:
        """The connection for everything but indexing (opened on first use: the embedder loads with it)."""
        with self._lock:
            if self._reader is None:
                self._reader = self._open()
                if self._reader.missing_vectors(1):  # another embedder's vectors were dropped
                    self._enqueue(EMBED_MISSING)
            return self._reader

    def start(self) -> None:
        """Bring every collection up to date in the background (what changed while the app was not running, an
        indexing a killed process left), and watch the folders for changes."""
        for name, root, _ in self.index.collections():
            self.refresh(name)
            self._watch(name, Path(root))

    def _watch(self, name: str, root: Path) -> None:
        """Refresh `name` whenever a file under `root` changes, until the collection is deleted or the app stops
        (an uploaded collection changes only through the app, which refreshes it then)."""
        if self._uploaded(root) or name in self._watching:
            return
        stop = self._watching[name] = threading.Event()

        def watch() -> None:
            import watchfiles

            try:
                for _ in watchfiles.watch(root, stop_event=stop, recursive=True, raise_interrupt=False):
                    if name in self.names():
                        self.refresh(name)
            except (OSError, RuntimeError) as e:  # the folder went away, or the system has no watches left
                self.say(f"[documents] {name}: changes in {root} are no longer followed ({e}); Refresh reads them")

        threading.Thread(target=watch, name=f"documents-watch-{name}", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            for stop in self._watching.values():
                stop.set()
            for job in self._jobs.values():
                job.cancel.set()
        self._queue.put(None)
        if self._worker is not None:
            self._worker.join(timeout=30)
        if self._reader is not None:
            self._reader.close()

    # ---- collections -----------------------------------------------------------------------------

    @_locked
    def names(self) -> list[str]:
        return [name for name, _, _ in self.index.collections()]

    @_locked
    def check(self, name: object) -> str:
        """`name` if it is a collection, else a `UserError` listing those there are."""
        names = self.names()
        if name not in names:
            there = ", ".join(names) or "none yet: add one in the Documents tab, or start with --docs NAME=FOLDER"
            raise UserError(f"there is no collection named {name!r} (collections: {there})", "collection")
        return name

    @_locked
    def add_folder(self, name: str, folder: Path) -> None:
        """A collection of the files under `folder`, read where they are, indexed now in the background."""
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise UserError(f"{folder} is not a folder on this machine" + (
                "" if folder.exists() else " (it does not exist)"), "folder")
        self.index.add_collection(_checked_name(name), str(folder.resolve()))
        self.refresh(name)
        self._watch(name, folder.resolve())

    @_locked
    def add_files(self, name: str, files: list[Path]) -> None:
        """Uploaded `files` into collection `name` (made if it is new), copied into the data folder."""
        name = _checked_name(name)
        if not files:
            raise UserError("choose the files to upload first", "files")
        existing = {n: root for n, root, _ in self.index.collections()}
        if name in existing and not self._uploaded(Path(existing[name])):
            raise UserError(f"{name!r} reads the folder {existing[name]}: put the files there and press Refresh, "
                            f"or upload them into another collection", "files")
        root = Path(existing[name]) if name in existing else self.uploads / f"{_slug(name)}-{secrets.token_hex(3)}"
        root.mkdir(parents=True, exist_ok=True)
        for path in files:
            shutil.copyfile(path, root / Path(path).name)
        if name not in existing:
            self.index.add_collection(name, str(root))
        self.refresh(name)

    @_locked
    def remove_file(self, name: str, path: str) -> bool:
        """Take a file out of a collection: an uploaded copy is deleted (True); a file of the user's folder stays
        on disk and is passed over from now on (False)."""
        cid, root = self.index.collection(name), self._root(name)
        if not self._uploaded(root):
            self.index.exclude(cid, path)
            return False
        (root / path).unlink(missing_ok=True)
        self.index.remove_file(cid, path)
        return True

    @_locked
    def delete(self, name: str) -> None:
        """Delete a collection (`restore` brings it back for `UNDO_S` seconds)."""
        self.check(name)
        with self._lock:
            if name in self._jobs:
                self._jobs[name].cancel.set()
            if name in self._watching:
                self._watching.pop(name).set()
        self.index.set_deleted(name, True)

    @_locked
    def restore(self, name: str) -> None:
        self._purge()
        if name not in [n for n, _, _ in self.index.deleted()]:
            raise UserError(f"the collection {name!r} cannot be restored: it was deleted for good ({UNDO_S} s after "
                            f"Delete)")
        self.index.set_deleted(name, False)
        self.refresh(name)
        self._watch(name, self._root(name))

    def _purge(self) -> None:
        due = time.time() - UNDO_S
        for name, root, deleted in self.index.deleted():
            if deleted < due and root and self._uploaded(Path(root)):
                shutil.rmtree(root, ignore_errors=True)
        self.index.purge_deleted(due)

    @_locked
    def listing(self) -> list[CollectionView]:
        """Every collection with its files (those that could not be read with why) and its indexing's state."""
        self._purge()
        views = []
        again = self._jobs.get(EMBED_MISSING)  # another embedder's vectors being made anew: every collection's
        for name, root, indexed in self.index.collections():
            with self._lock:
                job = again if again is not None and again.busy else self._jobs.get(name, Job("", False))
                state, busy = job.state, job.busy
            views.append(CollectionView(name, Path(root), self._uploaded(Path(root)), indexed,
                                        self.index.files(self.index.collection(name)), state, busy))
        return views

    def _root(self, name: str) -> Path:
        return next(Path(root) for n, root, _ in self.index.collections() if n == name)

    def _uploaded(self, root: Path) -> bool:
        return root.is_relative_to(self.uploads)

    # ---- indexing in the background ----------------------------------------------------------------

    def refresh(self, name: str) -> None:
        """Bring `name` up to date with its folder, in the background (nothing if it is already waiting)."""
        self.check(name)
        self._enqueue(name)

    def cancel(self, name: str) -> None:
        with self._lock:
            if name in self._jobs and self._jobs[name].busy:
                self._jobs[name].cancel.set()
                self._jobs[name].state = "cancelling…"

    def _enqueue(self, job: str) -> None:
        with self._lock:
            if job in self._jobs and self._jobs[job].busy and not self._jobs[job].cancel.is_set():
                return
            self._jobs[job] = Job()
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="documents-indexer", daemon=True)
                self._worker.start()
        self._queue.put(job)

    def _work(self) -> None:
        """Jobs one after another; the index is opened with the first (an embedder that cannot load fails that
        job in words, and the next job tries again)."""
        index = indexer = None
        try:
            while (name := self._queue.get()) is not None:
                job = self._jobs[name]
                try:
                    if indexer is None:
                        index = self._open()
                        indexer = Indexer(index, self.embedder.get())
                    line = self._run(index, indexer, name, job)
                    job.state = f"{line}; reading its vectors for questions"
                    self._read_vectors(index, name)
                except Exception as e:  # noqa: BLE001 - one collection's failure is said, the app goes on
                    line = f"indexing stopped: {e}"
                with self._lock:
                    job.state, job.busy = line, False
                self.say(f"[documents] {name or 'embedder'}: {line}")
        finally:
            if index is not None:
                index.close()

    def _run(self, index: Index, indexer: Indexer, name: str, job: Job) -> str:
        said = [0.0]

        def progress(line: str) -> None:
            job.state = line
            if time.monotonic() - said[0] >= SAY_EVERY_S:
                said[0] = time.monotonic()
                self.say(f"[documents] {line}")

        if name == EMBED_MISSING:
            done = embed_missing(index, indexer.embedder, progress, job.cancel)
            return f"{done} passages embedded again with {indexer.embedder.name}"
        root = next((Path(r) for n, r, _ in index.collections() if n == name), None)
        if job.cancel.is_set() or root is None:
            return "cancelled"
        return indexer.refresh(name, root, progress, job.cancel).line()

    @staticmethod
    def _read_vectors(index: Index, job: str) -> None:
        """The vectors of the collection a job refreshed (all, after a re-embedding) into memory now, so that its
        first question does not wait for the read (a million vectors: about 15 s on 2 cores)."""
        for name in [n for n, _, _ in index.collections()] if job == EMBED_MISSING else [job]:
            try:
                index.read_vectors(index.collection(name))
            except UserError:  # deleted meanwhile
                continue

    # ---- questions and their sources ---------------------------------------------------------------

    @_locked
    def sources(self, name: str, question: str, budget: int, count: Callable[[str], int]) -> list[Source]:
        """Numbered sources from collection `name` for `question`, their texts at most `budget` tokens (`count`)."""
        if self._load_reranker is not None and self._reranker is None:
            self._reranker = self._load_reranker()
        return retrieve(self.index, self.embedder.get(), self.check(name), question, budget, count,
                        self._reranker.score if self._reranker is not None else None)

    def _link_key(self) -> bytes:
        """The key that signs links to source files (kept, so links in saved conversations keep working)."""
        path = self.folder / "documents-link.key"
        if not path.is_file():
            atomic_write(path, secrets.token_hex(32), mode=0o600)
        return path.read_text().strip().encode()

    def link(self, source: Source) -> str:
        """The address that opens `source`'s file at its place (a PDF at its page)."""
        key = hmac.new(self._key, str(source.file_id).encode(), hashlib.sha256).hexdigest()[:24]
        return f"/documents/source/{source.file_id}?key={key}" + (f"#page={source.page}" if source.page else "")

    @_locked
    def shown(self, citations: CitationStream) -> list[dict]:
        """A reply's sources as every front end shows them (and the store keeps them): those it cited, else (a
        model that cites nothing) those it was given, `cited` saying which; each with its number, file, page,
        heading, where (in words), text, and the link that opens the file there."""
        sources = citations.cited or list(citations.given.values())
        return [{"number": s.number, "file": s.file, "page": s.page, "heading": s.heading, "where": s.where,
                 "text": s.text, "link": self.link(s), "cited": bool(citations.cited)} for s in sources]

    def source_file(self, file: int, key: str) -> Path:
        """The file a `link` names, or a `UserError` when the link is not one this app made or it is gone."""
        wanted = hmac.new(self._key, str(file).encode(), hashlib.sha256).hexdigest()[:24]
        place = self.index.file_place(file) if hmac.compare_digest(wanted, str(key)) else None
        if place is None:
            raise UserError("this source is no longer in a collection (or the link is not one this app made)")
        path = Path(place[1]) / place[2]
        if not path.is_file():
            raise UserError(f"{place[2]} is no longer in {place[1]}: press Refresh in the Documents tab")
        return path


def _checked_name(name: object) -> str:
    name = " ".join(str(name or "").split())
    if not NAME.match(name):
        raise UserError("name the collection with up to 60 letters, digits, spaces or .,'()- (it starts with a "
                        "letter or digit)", "name")
    return name


def _slug(name: str) -> str:
    return re.sub(r"[^\w-]+", "-", name).strip("-")[:40] or "collection"
