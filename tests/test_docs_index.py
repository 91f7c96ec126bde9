"""The documents index (`pipeline/docs/index.py`, `indexer.py`): incremental (a changed file alone is read and
embedded again, a removed one's passages are gone from both searches), consistent after a SIGKILL at any moment
of indexing (no passage missing or doubled, its full-text and vector rows matching), and resuming where it
stopped; an embedder switch re-embeds every passage instead of mixing vectors."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.docs.index import Index, connect
from pipeline.docs.indexer import OVERLAP_SHARE, Indexer, embed_missing
from pipeline.docs.chunking import passages
from pipeline.docs.readers import read_document

ROOT = Path(__file__).resolve().parents[1]


class WordEmbedder:
    """A word a token; a text's vector its words hashed into 16 buckets (a real ranking, cheaply); every text
    it embeds is recorded."""

    dim, max_tokens = 16, 40

    def __init__(self, name: str = "words", delay: float = 0.0):
        self.name, self.delay, self.seen = name, delay, []

    def count_tokens(self, text: str) -> int:
        return len(text.split()) + 2

    def overhead(self, prompt: str | None = None) -> int:
        return 2

    def encode(self, texts: list[str], prompt: str | None = None) -> np.ndarray:
        time.sleep(self.delay)
        self.seen.extend(texts)
        out = np.zeros((len(texts), self.dim), np.float32)
        for row, text in enumerate(texts):
            for word in text.lower().split():
                out[row, sum(map(ord, word)) % self.dim] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def write_files(folder: Path, n: int, paragraphs: int = 6) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        texts = [f"Document {i} paragraph {j}: the keeper{i} logs ship number {i * 100 + j} passing the reef "
                 f"at dusk, with the lamp turning and the horn sounding." for j in range(paragraphs)]
        (folder / f"doc{i:03d}.md").write_text(f"# Log {i}\n\n" + "\n\n".join(texts))


def expected_passages(path: Path, embedder) -> int:
    limit = embedder.max_tokens - 2
    return len(passages(read_document(path), lambda t: embedder.count_tokens(t) - 2, limit,
                        int(limit * OVERLAP_SHARE)))


def check_consistent(db_path: Path, folder: Path, embedder) -> int:
    """Every indexed file has exactly its passages (seq 0…n−1, each with one full-text and one vector row);
    returns how many files are indexed."""
    db = connect(db_path)
    try:
        db.execute("INSERT INTO passages_fts(passages_fts) VALUES ('integrity-check')")  # raises when they differ
        files = db.execute("SELECT id, path FROM files WHERE reason IS NULL").fetchall()
        for file, path in files:
            seqs = [row[0] for row in db.execute("SELECT seq FROM passages WHERE file = ? ORDER BY seq", (file,))]
            assert seqs == list(range(expected_passages(folder / path, embedder))), (path, seqs)
        total = db.execute("SELECT count(*) FROM passages").fetchone()[0]
        assert db.execute("SELECT count(*) FROM vectors").fetchone()[0] == total
        assert db.execute("SELECT count(*) FROM passages_fts_docsize").fetchone()[0] == total
        return len(files)
    finally:
        db.close()


def test_a_changed_file_alone_is_embedded_again_and_a_removed_ones_passages_are_gone(tmp_path):
    folder = tmp_path / "docs"
    write_files(folder, 5)
    embedder = WordEmbedder()
    index = Index(tmp_path / "index.db", embedder.name, embedder.dim)
    index.add_collection("logs", str(folder))
    indexer = Indexer(index, embedder)
    assert indexer.refresh("logs", folder).read == 5
    cid = index.collection("logs")
    assert index.keyword_search(cid, "keeper3", 5)
    embedder.seen.clear()
    (folder / "doc002.md").write_text("# Log 2\n\nThe keeper2 saw a whale today.")
    (folder / "doc003.md").unlink()
    summary = indexer.refresh("logs", folder)
    assert (summary.read, summary.unchanged, summary.removed) == (1, 3, 1), summary
    assert embedder.seen == ["# Log 2\n\nThe keeper2 saw a whale today."]
    assert not index.keyword_search(cid, "keeper3", 5) and not [h for h in index.hits(index.vector_search(
        cid, embedder.encode(["keeper3"])[0], 50)) if h.file == "doc003.md"]
    assert [h.file for h in index.hits(index.keyword_search(cid, "whale", 5))] == ["doc002.md"]
    assert check_consistent(tmp_path / "index.db", folder, embedder) == 4


def indexed(tmp_path: Path, files: int) -> tuple[Path, WordEmbedder, Index, Indexer]:
    """A folder of `files` logs indexed as the collection "logs": (the folder, the embedder, the index, its
    indexer)."""
    folder = tmp_path / "docs"
    write_files(folder, files)
    embedder = WordEmbedder()
    index = Index(tmp_path / "index.db", embedder.name, embedder.dim)
    index.add_collection("logs", str(folder))
    indexer = Indexer(index, embedder)
    indexer.refresh("logs", folder)
    return folder, embedder, index, indexer


def test_a_file_whose_size_and_time_are_unchanged_is_not_even_hashed(tmp_path, monkeypatch):
    """A refresh of a big folder reads only the file system's listing for what did not change: no file's bytes."""
    from pipeline.docs import indexer as indexer_module

    folder, embedder, index, indexer = indexed(tmp_path, 4)
    hashed = []
    monkeypatch.setattr(indexer_module, "content_hash", lambda path: hashed.append(path.name) or
                        indexer_module.hashlib.sha256(path.read_bytes()).hexdigest())
    assert indexer.refresh("logs", folder).unchanged == 4 and hashed == []
    (folder / "doc001.md").write_text((folder / "doc001.md").read_text().replace("dusk", "dawn"))  # same size
    summary = indexer.refresh("logs", folder)
    assert (summary.read, summary.unchanged) == (1, 3) and set(hashed) == {"doc001.md"}



def test_a_write_takes_the_lock_as_it_begins_so_the_other_connections_write_waits_for_it(tmp_path):
    """The app's connection adds a collection while the indexing thread's writes: the app's transaction reads,
    then writes. Had it only read-locked at first, the indexer's write would slip in and the app's own write fail
    at once with "database is locked" (CI saw it); holding the write lock from its start, the other waits."""
    import apsw

    app, indexer = Index(tmp_path / "index.db", "words", 16), Index(tmp_path / "index.db", "words", 16)
    indexer.db.set_busy_timeout(0)  # refused at once rather than waiting, so this test needs no second thread
    with app.writing():
        app.collections()
        try:
            indexer.add_collection("logs", None)
            raise AssertionError("the indexer wrote inside the app's write transaction")
        except apsw.BusyError:
            pass
        app.add_collection("notes", None)
    indexer.add_collection("logs", None)
    assert [name for name, _, _ in app.collections()] == ["logs", "notes"]


CHILD = """
import sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from test_docs_index import WordEmbedder
from pipeline.docs.index import Index
from pipeline.docs.indexer import Indexer
from pipeline.errors import UserError

embedder = WordEmbedder()
index = Index(Path(sys.argv[2]), embedder.name, embedder.dim)
try:
    index.collection("logs")
except UserError:
    index.add_collection("logs", sys.argv[3])
print(Indexer(index, embedder).refresh("logs", Path(sys.argv[3])).line(), flush=True)
"""


def files_in(db_path: Path) -> int:
    """Files the index lists now (0 while the child is still making it)."""
    try:
        db = connect(db_path)
        try:
            return db.execute("SELECT count(*) FROM files").fetchone()[0]
        finally:
            db.close()
    except Exception:  # noqa: BLE001 - no database or no table yet
        return 0


def test_sigkills_while_indexing_leave_every_file_whole_and_the_next_refresh_resumes(tmp_path):
    """Files of 120 passages each, so that most of the time goes to writing them: three kills at moments the
    index grows, each followed by the check."""
    folder, db_path = tmp_path / "docs", tmp_path / "index.db"
    write_files(folder, 40, paragraphs=120)
    embedder, before = WordEmbedder(), 0
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT), str(db_path), str(folder)])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None and files_in(db_path) < before + 3:
            time.sleep(0.005)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        now = check_consistent(db_path, folder, embedder)
        assert before <= now < 40, (before, now)
        before = now
    index = Index(db_path, embedder.name, embedder.dim)
    summary = Indexer(index, embedder).refresh("logs", folder)
    assert (summary.unchanged, summary.read) == (before, 40 - before), summary
    assert check_consistent(db_path, folder, embedder) == 40


def test_another_embedder_re_embeds_every_passage_never_mixing_vectors(tmp_path):
    folder = tmp_path / "docs"
    write_files(folder, 3)
    index = Index(tmp_path / "index.db", "words", 16)
    index.add_collection("logs", str(folder))
    Indexer(index, WordEmbedder()).refresh("logs", folder)
    total = index.db.execute("SELECT count(*) FROM passages").fetchone()[0]
    index.close()
    other = WordEmbedder("other")
    index = Index(tmp_path / "index.db", other.name, other.dim)
    assert len(index.missing_vectors(1000)) == total
    assert index.db.execute("SELECT count(*) FROM vectors").fetchone()[0] == 0
    assert embed_missing(index, other, batch=7) == total and len(other.seen) == total
    assert not index.missing_vectors(10) and check_consistent(tmp_path / "index.db", folder, other) == 3


def test_the_vector_cache_follows_changes_reading_only_what_changed(tmp_path, monkeypatch):
    """A question after files were added, changed and removed finds what a fresh index finds (exact), while the
    warm cache read only the changed rows; after an embedder switch every vector is read again."""
    from pipeline.docs import vector_cache

    folder, embedder, index, indexer = indexed(tmp_path, 6)
    cid = index.collection("logs")
    queries = embedder.encode(["keeper2 ship reef", "whale gale lamp", "horn dusk keeper5", "supply boat"])
    [index.vector_search(cid, q, 8) for q in queries]  # the cache warm
    read = []
    real = vector_cache.Block.of
    monkeypatch.setattr(vector_cache.Block, "of", classmethod(lambda cls, rows: read.append(r := real(rows)) or r))
    (folder / "doc002.md").write_text("# Log 2\n\nThe keeper2 saw a whale and a gale.")
    (folder / "doc004.md").unlink()
    (folder / "new.md").write_text("# New\n\nThe supply boat came with oil for the lamp.")
    indexer.refresh("logs", folder)
    warm = [index.vector_search(cid, q, 8) for q in queries]
    fresh = Index(tmp_path / "index.db", embedder.name, embedder.dim)
    assert scored(fresh, cid, queries, warm) == scored(fresh, cid, queries, [fresh.vector_search(cid, q, 8)
                                                                             for q in queries])
    assert [len(block.ids) for block in read[:1]] == [2]  # doc002's and new.md's passages, not the collection's
    assert not {pid for found in warm for pid in found} - {h.id for h in index.hits(sorted({p for f in warm for p in f}))}

    switched = WordEmbedder("other words")
    index.use_embedder(switched.name, switched.dim)
    embed_missing(index, switched)
    read.clear()
    assert scored(fresh, cid, queries, [index.vector_search(cid, q, 8) for q in queries]) == \
        scored(fresh, cid, queries, [fresh.vector_search(cid, q, 8) for q in queries])
    every = fresh.db.execute("SELECT count(*) FROM vectors").fetchone()[0]
    assert [len(block.ids) for block in read] == [every, every]  # both caches read everything again


def scored(index, cid, queries, found) -> list[list[float]]:
    """Each query's found passages as their cosines (rounded), so that equal vectors in another order compare
    equal."""
    vectors = {pid: np.frombuffer(blob, np.float32) for pid, blob in index.db.execute(
        "SELECT passage, embedding FROM vectors WHERE collection = ?", (cid,))}
    return [[round(float(vectors[pid] @ q / np.linalg.norm(vectors[pid]) / np.linalg.norm(q)), 5) for pid in ids]
            for q, ids in zip(queries, found)]
