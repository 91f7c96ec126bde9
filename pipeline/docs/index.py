"""The documents index: one SQLite database in the data folder (`apsw`, which bundles a current SQLite with FTS5),
holding for every collection its files (with their content hash, or why they could not be read), their passages,
a full-text index of them (FTS5, BM25) and their vectors (float32, one row a passage).

The nearest vectors are found by one matrix product over the collection's vectors, held in memory and kept up to
date by what changed (`vector_cache.py`). Measured at a million 384-wide vectors on this workplace's 2-core CPU
(`bench/docs_index.py`): 100–150 ms a question, exact; sqlite-vec's `vec0` scan took 689 ms for the same (float32),
and 589 ms with binary codes, which found only a fifth of the true 40 nearest (bench/RESULTS.md).

Every change to one file is one transaction (`replace_file`, `mark_unreadable`, `remove_file`): a process killed
at any moment leaves each file either as it was or as it is now, and the next refresh goes on from there. The
database is in WAL mode, so chats read it while the indexer writes. The vectors are the embedder's named in
`meta`; another embedder's would not compare, so switching drops them all (`use_embedder`) and they are made anew.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pipeline.docs.chunking import Passage
from pipeline.docs.vector_cache import Source as VectorSource, VectorCache
from pipeline.errors import UserError

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS collections(
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, root TEXT, created REAL NOT NULL, indexed REAL,
    deleted REAL, generation INTEGER NOT NULL DEFAULT 0, pruned INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS files(
    id INTEGER PRIMARY KEY, collection INTEGER NOT NULL REFERENCES collections(id) ON DELETE CASCADE,
    path TEXT NOT NULL, hash TEXT, size INTEGER, pages INTEGER, reason TEXT, indexed REAL NOT NULL,
    modified INTEGER, UNIQUE(collection, path));
CREATE TABLE IF NOT EXISTS passages(
    id INTEGER PRIMARY KEY AUTOINCREMENT, file INTEGER NOT NULL REFERENCES files(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    text TEXT NOT NULL, start INTEGER NOT NULL, end INTEGER NOT NULL, page INTEGER, heading TEXT,
    vector INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS passages_by_file ON passages(file, seq);
CREATE TABLE IF NOT EXISTS vectors(
    passage INTEGER PRIMARY KEY, collection INTEGER NOT NULL, embedding BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS vectors_by_collection ON vectors(collection);
CREATE TRIGGER IF NOT EXISTS vectors_add AFTER INSERT ON vectors BEGIN
    UPDATE collections SET generation = generation + 1 WHERE id = new.collection; END;
CREATE TABLE IF NOT EXISTS vectors_removed(collection INTEGER NOT NULL, generation INTEGER NOT NULL,
    passage INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS vectors_removed_since ON vectors_removed(collection, generation);
CREATE TRIGGER IF NOT EXISTS vectors_drop AFTER DELETE ON vectors BEGIN
    UPDATE collections SET generation = generation + 1 WHERE id = old.collection;
    INSERT INTO vectors_removed SELECT old.collection, generation, old.passage FROM collections
        WHERE id = old.collection; END;
CREATE TABLE IF NOT EXISTS excluded(
    collection INTEGER NOT NULL REFERENCES collections(id) ON DELETE CASCADE, path TEXT NOT NULL,
    PRIMARY KEY(collection, path));
CREATE VIRTUAL TABLE IF NOT EXISTS passages_fts USING fts5(
    text, heading, content='passages', content_rowid='id', tokenize='porter unicode61 remove_diacritics 2');
CREATE TRIGGER IF NOT EXISTS passages_fts_add AFTER INSERT ON passages BEGIN
    INSERT INTO passages_fts(rowid, text, heading) VALUES (new.id, new.text, new.heading); END;
CREATE TRIGGER IF NOT EXISTS passages_fts_drop AFTER DELETE ON passages BEGIN
    INSERT INTO passages_fts(passages_fts, rowid, text, heading) VALUES ('delete', old.id, old.text, old.heading);
    DELETE FROM vectors WHERE passage = old.id; END;
"""


PRUNE_REMOVED = 100_000  # rows of the removal log a collection keeps at most past an indexing

# Words a question is made of that say nothing of its subject: matched, they rank every passage that has them
STOPWORDS = frozenset("""a an and are as at be by can could do does for from had has have how i if in into is it its
me my of on or our should so than that the their them then there these they this to was we what when where which who
why will with would you your""".split())


@dataclasses.dataclass(frozen=True)
class FileRow:
    id: int
    path: str
    hash: str | None
    size: int | None
    pages: int | None
    reason: str | None  # None: indexed
    indexed: float
    modified: int | None  # the file's modification time (ns) when it was read
    passages: int


@dataclasses.dataclass(frozen=True)
class Hit:
    """A passage found, with its file and place."""

    id: int
    file: str
    seq: int
    file_id: int
    text: str
    start: int
    end: int
    page: int | None
    heading: str | None


def connect(path: Path):
    """The index database at `path` (made if missing), WAL mode, foreign keys on."""
    import apsw

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        db = apsw.Connection(str(path))
        db.set_busy_timeout(30_000)
        db.execute("PRAGMA journal_mode=WAL; PRAGMA foreign_keys=ON; PRAGMA synchronous=NORMAL")
        return db
    except apsw.Error as e:
        raise UserError(f"the documents index {path} cannot be opened ({e}); move it aside and restart to "
                        f"index again") from None


class Index:
    """The index in `path`, its vectors `dim` wide from the embedder `embedder`."""

    def __init__(self, path: Path, embedder: str, dim: int, vectors: VectorCache | None = None):
        """`vectors`: the in-memory vectors, shared with the index's other connections (the indexing thread's)."""
        self.path, self.db = Path(path), connect(Path(path))
        self.vectors = vectors if vectors is not None else VectorCache()
        self.use_embedder(embedder, dim)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """One write transaction that takes the write lock as it begins. A deferred one (SQLite's default) that
        reads first and then writes fails at once with "database is locked", the busy timeout unused, when the
        index's other connection wrote in between."""
        if self.db.in_transaction:  # inside another: a savepoint of it
            with self.db:
                yield
            return
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _one(self, sql: str, args: Sequence = ()):
        row = self.db.execute(sql, args).fetchone()
        return None if row is None else row[0]

    def use_embedder(self, embedder: str, dim: int) -> bool:
        """Make the vectors `embedder`'s; True when they were another's (all dropped: every passage needs its
        vector again, `missing_vectors`)."""
        with self.writing():
            self.db.execute("CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT)")
            before = self._one("SELECT value FROM meta WHERE key = 'embedder'")
            now = f"{embedder} {dim}"
            self.db.execute(SCHEMA)
            if before not in (None, now):
                self.db.execute("DELETE FROM vectors")
                self.db.execute("UPDATE passages SET vector = 0")
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('embedder', ?)", (now,))
        return before not in (None, now)

    # ---- collections ---------------------------------------------------------------------------

    def add_collection(self, name: str, root: str | None) -> int:
        with self.writing():
            existing = self.db.execute("SELECT id, deleted FROM collections WHERE name = ?", (name,)).fetchone()
            if existing and existing[1] is None:
                raise UserError(f"there is already a collection named {name!r}: pick another name, or refresh it")
            if existing:  # a deleted one's name is taken again: its rows go for good
                self.db.execute("DELETE FROM collections WHERE id = ?", (existing[0],))
            self.db.execute("INSERT INTO collections(name, root, created) VALUES (?, ?, ?)", (name, root, time.time()))
            return self.db.last_insert_rowid()

    def collection(self, name: str) -> int:
        found = self._one("SELECT id FROM collections WHERE name = ? AND deleted IS NULL", (name,))
        if found is None:
            raise UserError(f"there is no collection named {name!r}")
        return found

    def collections(self) -> list[tuple[str, str | None, float | None]]:
        """(name, root folder, last indexed) of each collection, by name."""
        return self.db.execute("SELECT name, root, indexed FROM collections WHERE deleted IS NULL ORDER BY name"
                               ).fetchall()

    def deleted(self) -> list[tuple[str, str | None, float]]:
        """(name, root folder, when deleted) of each collection deleted and not yet purged."""
        return self.db.execute("SELECT name, root, deleted FROM collections WHERE deleted IS NOT NULL").fetchall()

    def set_deleted(self, name: str, deleted: bool) -> None:
        """Hide a collection (deleted: True) or bring it back (Undo); `purge_deleted` removes hidden ones."""
        with self.writing():
            self.db.execute("UPDATE collections SET deleted = ? WHERE name = ?", (time.time() if deleted else None,
                                                                                   name))

    def purge_deleted(self, before: float) -> None:
        """Remove for good the collections deleted before `before` (a time)."""
        with self.writing():
            for (cid,) in self.db.execute("SELECT id FROM collections WHERE deleted < ?", (before,)).fetchall():
                self.db.execute("DELETE FROM passages WHERE file IN (SELECT id FROM files WHERE collection = ?)",
                                (cid,))
                self.db.execute("DELETE FROM collections WHERE id = ?", (cid,))

    def mark_indexed(self, collection: int) -> None:
        """The collection is up to date now; its log of removed vectors is forgotten once it holds
        `PRUNE_REMOVED` (a cache older than that reads the collection's vectors again)."""
        with self.writing():
            self.db.execute("UPDATE collections SET indexed = ? WHERE id = ?", (time.time(), collection))
            if self._one("SELECT count(*) FROM vectors_removed WHERE collection = ?", (collection,)) > PRUNE_REMOVED:
                self.prune_removed(collection)

    # ---- files -----------------------------------------------------------------------------------

    def files(self, collection: int) -> list[FileRow]:
        rows = self.db.execute(
            "SELECT f.id, f.path, f.hash, f.size, f.pages, f.reason, f.indexed, f.modified, "
            "(SELECT count(*) FROM passages p WHERE p.file = f.id) FROM files f WHERE collection = ? ORDER BY path",
            (collection,)).fetchall()
        return [FileRow(*row) for row in rows]

    def replace_file(self, collection: int, path: str, digest: str, size: int, pages: int,
                     passages: Sequence[Passage], vectors: np.ndarray, modified: int | None = None) -> None:
        """The file's passages and vectors now these, in one transaction (its old ones gone)."""
        with self.writing():
            self.db.execute("INSERT INTO files(collection, path, hash, size, pages, reason, indexed, modified) "
                            "VALUES (?, ?, ?, ?, ?, NULL, ?, ?) ON CONFLICT(collection, path) DO UPDATE SET "
                            "hash = excluded.hash, size = excluded.size, pages = excluded.pages, reason = NULL, "
                            "indexed = excluded.indexed, modified = excluded.modified",
                            (collection, path, digest, size, pages, time.time(), modified))
            file = self._one("SELECT id FROM files WHERE collection = ? AND path = ?", (collection, path))
            self.db.execute("DELETE FROM passages WHERE file = ?", (file,))
            for seq, (p, vector) in enumerate(zip(passages, vectors)):
                self.db.execute("INSERT INTO passages(file, seq, text, start, end, page, heading, vector) "
                                "VALUES (?, ?, ?, ?, ?, ?, ?, 1)", (file, seq, p.text, p.start, p.end, p.page,
                                                                   p.heading))
                self._put_vector(self.db.last_insert_rowid(), collection, vector)

    def mark_unreadable(self, collection: int, path: str, reason: str, size: int | None = None) -> None:
        """The file listed with why it cannot be read; its passages (from an earlier version) gone."""
        with self.writing():
            self.db.execute("INSERT INTO files(collection, path, hash, size, pages, reason, indexed) "
                            "VALUES (?, ?, NULL, ?, NULL, ?, ?) ON CONFLICT(collection, path) DO UPDATE SET "
                            "hash = NULL, size = excluded.size, pages = NULL, reason = excluded.reason, "
                            "indexed = excluded.indexed", (collection, path, size, reason, time.time()))
            self.db.execute("DELETE FROM passages WHERE file = (SELECT id FROM files WHERE collection = ? AND "
                            "path = ?)", (collection, path))

    def exclude(self, collection: int, path: str) -> None:
        """Take the file out of the collection for good (its passages gone; refreshes pass it over)."""
        with self.writing():
            self.db.execute("INSERT OR IGNORE INTO excluded VALUES (?, ?)", (collection, path))
            self.remove_file(collection, path)

    def excluded(self, collection: int) -> set[str]:
        return {row[0] for row in self.db.execute("SELECT path FROM excluded WHERE collection = ?", (collection,))}

    def file_place(self, file: int) -> tuple[str, str | None, str] | None:
        """(collection name, its root, the file's path in it) of file id `file`, if it is indexed now."""
        return self.db.execute("SELECT c.name, c.root, f.path FROM files f JOIN collections c ON c.id = f.collection "
                               "WHERE f.id = ? AND f.reason IS NULL AND c.deleted IS NULL", (file,)).fetchone()

    def remove_file(self, collection: int, path: str) -> None:
        with self.writing():
            self.db.execute("DELETE FROM passages WHERE file = (SELECT id FROM files WHERE collection = ? AND "
                            "path = ?)", (collection, path))
            self.db.execute("DELETE FROM files WHERE collection = ? AND path = ?", (collection, path))

    # ---- vectors after an embedder switch ----------------------------------------------------------

    def missing_vectors(self, limit: int) -> list[tuple[int, int, str]]:
        """(passage id, collection, text) of passages without a vector, at most `limit`."""
        return self.db.execute("SELECT p.id, f.collection, p.text FROM passages p JOIN files f ON f.id = p.file "
                               "WHERE p.vector = 0 LIMIT ?", (limit,)).fetchall()

    def _put_vector(self, passage: int, collection: int, vector: np.ndarray) -> None:
        """(A plain delete then insert: a REPLACE would not run the delete trigger the vector cache reads.)"""
        self.db.execute("DELETE FROM vectors WHERE passage = ?", (passage,))
        self.db.execute("INSERT INTO vectors VALUES (?, ?, ?)",
                        (passage, collection, np.asarray(vector, np.float32).tobytes()))

    def set_vectors(self, rows: Iterable[tuple[int, int]], vectors: np.ndarray) -> None:
        with self.writing():
            for (pid, collection), vector in zip(rows, vectors):
                self._put_vector(pid, collection, vector)
                self.db.execute("UPDATE passages SET vector = 1 WHERE id = ?", (pid,))

    # ---- search ------------------------------------------------------------------------------------

    def keyword_search(self, collection: int, query: str, k: int) -> list[int]:
        """Passage ids best first by BM25 over the query's words (any of them)."""
        words = [w for w in "".join(ch if ch.isalnum() or ch == "_" else " " for ch in query).split()
                 if w.lower() not in STOPWORDS]
        if not words:
            return []
        match = " OR ".join(f'"{w}"' for w in words)
        return [row[0] for row in self.db.execute(
            "SELECT passages_fts.rowid FROM passages_fts JOIN passages p ON p.id = passages_fts.rowid "
            "JOIN files f ON f.id = p.file WHERE passages_fts MATCH ? AND f.collection = ? "
            "ORDER BY bm25(passages_fts) LIMIT ?", (match, collection, k))]

    def vector_search(self, collection: int, vector: np.ndarray, k: int) -> list[int]:
        """Passage ids nearest to `vector` (cosine), best first."""
        return self.vectors.search(collection, self._vector_source(collection), vector, k)

    def read_vectors(self, collection: int) -> None:
        """Bring the in-memory vectors of `collection` up to date now, before a question needs them."""
        self.vectors.update(collection, self._vector_source(collection))

    def _vector_source(self, collection: int) -> VectorSource:
        return VectorSource(
            state=lambda: self.db.execute("SELECT generation, pruned FROM collections WHERE id = ?",
                                          (collection,)).fetchone() or (0, 0),
            everything=lambda: self.db.execute("SELECT passage, embedding FROM vectors WHERE collection = ?",
                                               (collection,)),
            removed_since=lambda generation: [row[0] for row in self.db.execute(
                "SELECT passage FROM vectors_removed WHERE collection = ? AND generation > ?", (collection, generation))],
            added=lambda top, generation: self.db.execute(
                "SELECT passage, embedding FROM vectors WHERE collection = ? AND (passage > ? OR passage IN ("
                "SELECT passage FROM vectors_removed WHERE collection = ? AND generation > ?))",
                (collection, top, collection, generation)))

    def prune_removed(self, collection: int) -> None:
        """Forget the removal log of `collection` up to now (caches older than this read everything again)."""
        with self.writing():
            self.db.execute("UPDATE collections SET pruned = generation WHERE id = ?", (collection,))
            self.db.execute("DELETE FROM vectors_removed WHERE collection = ? AND generation <= "
                            "(SELECT pruned FROM collections WHERE id = ?)", (collection, collection))

    def hits(self, ids: Sequence[int]) -> list[Hit]:
        """The passages of `ids`, in that order."""
        if not ids:
            return []
        marks = ",".join("?" * len(ids))
        rows = {row[0]: Hit(*row) for row in self.db.execute(
            f"SELECT p.id, f.path, p.seq, f.id, p.text, p.start, p.end, p.page, p.heading FROM passages p "
            f"JOIN files f ON f.id = p.file WHERE p.id IN ({marks})", list(ids))}
        return [rows[i] for i in ids if i in rows]

    def neighbours(self, hit: Hit) -> list[Hit]:
        """The passages just before and after `hit` in its file."""
        rows = self.db.execute(
            "SELECT p.id, f.path, p.seq, f.id, p.text, p.start, p.end, p.page, p.heading FROM passages p "
            "JOIN files f ON f.id = p.file WHERE p.file = (SELECT file FROM passages WHERE id = ?) "
            "AND p.seq IN (?, ?) ORDER BY p.seq", (hit.id, hit.seq - 1, hit.seq + 1)).fetchall()
        return [Hit(*row) for row in rows]

