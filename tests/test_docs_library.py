"""The collections as the app keeps them (`pipeline/docs/library.py`), on the index tests' word embedder: a folder
indexed in the background with its unreadable file listed; a file removed from a folder collection stays on disk
and is passed over by later refreshes, one removed from an upload collection is deleted; uploading into a folder
collection is refused; a deleted collection comes back with Undo, and after the undo time it is gone with its
uploaded copies; a source's link opens its file, a forged or stale one nothing; the app's data survives a restart."""

import time
from pathlib import Path

import pytest

from pipeline.docs import library as library_module
from pipeline.docs.citations import CitationStream
from pipeline.docs.library import Library
from pipeline.embed.embedder import EmbedderSlot
from pipeline.errors import UserError
from test_docs_index import WordEmbedder, write_files


def settled(library: Library) -> list:
    deadline = time.time() + 60
    views = library.listing()
    while any(v.busy for v in views):
        assert time.time() < deadline, [v.state for v in views]
        time.sleep(0.05)
        views = library.listing()
    return views


@pytest.fixture
def folder(tmp_path) -> Path:
    write_files(tmp_path / "logs", 4)
    (tmp_path / "logs" / "noise.txt").write_bytes(bytes(range(256)) * 4)
    return tmp_path / "logs"


def test_a_folder_is_indexed_in_the_background_and_its_files_listed(tmp_path, folder):
    library = Library(tmp_path / "data", EmbedderSlot("words", WordEmbedder))
    library.add_folder("logs", folder)
    [view] = settled(library)
    assert (view.name, view.uploaded, len(view.files), view.pages) == ("logs", False, 5, 4)
    assert [(f.path, f.reason) for f in view.unreadable] == [("noise.txt", "binary content, not text (its name says text)")]
    assert view.state == "5 files: 4 read (4 pages), 0 unchanged, 1 could not be read"
    with pytest.raises(UserError, match="there is already a collection named 'logs'"):
        library.add_folder("logs", folder)
    with pytest.raises(UserError, match="is not a folder on this machine \\(it does not exist\\)"):
        library.add_folder("other", tmp_path / "nowhere")
    with pytest.raises(UserError, match="reads the folder .*: put the files there"):
        library.add_files("logs", [folder / "doc000.md"])
    library.close()

    again = Library(tmp_path / "data", EmbedderSlot("words", WordEmbedder))  # a restart
    again.start()
    [view] = settled(again)
    assert view.state == "5 files: 0 read (0 pages), 4 unchanged, 1 could not be read" and view.passages > 4
    again.close()


def test_the_vectors_are_in_memory_before_the_first_question_after_a_start(tmp_path, folder):
    """A restart brings each collection up to date, then reads its vectors into memory on the indexing thread: the
    first question reads no vector out of the database (at a million, that read takes 15 s)."""
    first = Library(tmp_path / "data", EmbedderSlot("words", WordEmbedder))
    first.add_folder("logs", folder)
    settled(first)
    first.close()
    library = Library(tmp_path / "data", EmbedderSlot("words", WordEmbedder))
    library.start()
    settled(library)
    read: list[str] = []
    library.index.db.exec_trace = lambda cursor, sql, bindings: read.append(sql) or True
    [source, *_] = library.sources("logs", "the keeper2 logs ship", 400, lambda text: len(text.split()))
    assert "keeper2" in source.text
    assert read and not [sql for sql in read if "embedding FROM vectors" in sql], read
    library.close()


def test_removing_a_file_keeps_the_users_file_and_deletes_an_uploaded_copy(tmp_path, folder):
    library = Library(tmp_path / "data", EmbedderSlot("words", WordEmbedder))
    library.add_folder("logs", folder)
    library.add_files("uploaded", [folder / "doc001.md", folder / "doc002.md"])
    settled(library)
    assert library.remove_file("logs", "doc000.md") is False
    assert (folder / "doc000.md").is_file()
    library.refresh("logs")
    logs, uploaded = settled(library)
    assert "doc000.md" not in [f.path for f in logs.files]  # passed over from now on
    assert library.remove_file("uploaded", "doc001.md") is True
    [copy] = [v for v in library.listing() if v.name == "uploaded"]
    assert [f.path for f in copy.files] == ["doc002.md"] and copy.uploaded
    assert not (copy.root / "doc001.md").exists() and (copy.root / "doc002.md").is_file()
    library.close()


def test_a_deleted_collection_comes_back_with_undo_then_goes_with_its_copies(tmp_path, folder, monkeypatch):
    library = Library(tmp_path / "data", EmbedderSlot("words", WordEmbedder))
    library.add_files("uploaded", [folder / "doc001.md"])
    [view] = settled(library)
    library.delete("uploaded")
    assert library.names() == []
    library.restore("uploaded")
    assert library.names() == ["uploaded"]
    library.delete("uploaded")
    monkeypatch.setattr(library_module, "UNDO_S", 0)
    time.sleep(0.01)
    assert library.listing() == [] and not view.root.exists()
    with pytest.raises(UserError, match="cannot be restored: it was deleted for good"):
        library.restore("uploaded")
    library.close()


def test_a_source_link_opens_its_file_and_a_forged_or_stale_one_nothing(tmp_path, folder):
    library = Library(tmp_path / "data", EmbedderSlot("words", WordEmbedder))
    library.add_folder("logs", folder)
    settled(library)
    sources = library.sources("logs", "ship number 302 passing the reef", 100, lambda text: len(text.split()))
    [shown] = library.shown(_citing(sources[0]))
    file, key = shown["link"].removeprefix("/documents/source/").split("?key=")
    assert library.source_file(int(file), key) == folder / sources[0].file
    with pytest.raises(UserError, match="not one this app made"):
        library.source_file(int(file), "0" * len(key))
    with pytest.raises(UserError, match="not one this app made"):
        library.source_file(int(file) + 1, key)  # a key is for its file only
    (folder / sources[0].file).unlink()
    with pytest.raises(UserError, match="is no longer in"):
        library.source_file(int(file), key)
    library.close()


def _citing(source) -> CitationStream:
    stream = CitationStream([source])
    stream.push(f"It is so [{source.number}].")
    return stream


def test_citations_are_checked_as_they_stream_whatever_the_pieces():
    from pipeline.docs.retrieval import Source

    sources = [Source(n, f"f{n}.txt", n, "text", 0, 4, None, None, (n,)) for n in (1, 2)]
    reply = "Use copytree [2]. It copies links [3]. See also [1, 4] and [2]; arrays use a[i] here [12]."
    for size in (1, 2, 3, 7, len(reply)):
        stream = CitationStream(sources)
        text = "".join(stream.push(reply[i:i + size]) for i in range(0, len(reply), size)) + stream.finish()
        assert text == "Use copytree [2]. It copies links. See also [1] and [2]; arrays use a[i] here."
        assert [s.number for s in stream.cited] == [2, 1]


def test_a_reranker_reorders_the_first_passages_found_and_loads_on_the_first_question(tmp_path, folder):
    """The reranker's own order wins over the fused one (here it prefers the keeper3 log, which the question
    does not name); it is loaded once, when the first question comes."""
    loads = []

    class PrefersKeeper3:
        @staticmethod
        def score(question: str, passages: list[str]):
            import numpy as np

            return np.array([float("keeper3" in p) for p in passages])

    library = Library(tmp_path / "data", EmbedderSlot("words", WordEmbedder),
                      reranker=lambda: loads.append(1) or PrefersKeeper3())
    library.add_folder("logs", folder)
    settled(library)
    assert loads == []
    for _ in range(2):
        sources = library.sources("logs", "ship number 101 passing the reef", 60, lambda text: len(text.split()))
        assert sources[0].file == "doc003.md" and "keeper3" in sources[0].text
    assert loads == [1]
    library.close()


def test_a_file_added_or_changed_in_the_folder_is_indexed_without_a_refresh(tmp_path, folder):
    """While the app runs, the folder is watched (the system's notifications): a new file and a changed one are
    read, the unchanged ones are not read again."""
    embedder = WordEmbedder()
    library = Library(tmp_path / "data", EmbedderSlot("words", lambda: embedder))
    library.add_folder("logs", folder)
    settled(library)
    embedder.seen.clear()
    (folder / "new.md").write_text("# New\n\nThe relief keeper arrived with the supply boat on Tuesday.")
    with open(folder / "doc001.md", "a") as f:
        f.write("\n\nA gale blew all night and the lamp stayed lit.")
    deadline = time.time() + 30
    while not ({"new.md"} <= {f.path for f in library.listing()[0].files} and
               any("gale" in text for text in embedder.seen) and not library.listing()[0].busy):
        assert time.time() < deadline, library.listing()[0].state
        time.sleep(0.1)
    assert all("keeper0" not in text for text in embedder.seen)  # doc000.md was not read again
    library.close()


def test_another_embedder_embeds_every_passage_again_showing_its_progress(tmp_path, folder):
    """The app started with another embedder: every collection says it is being embedded again until it is, and
    then every passage has the new embedder's vector (never the old one's)."""
    first = Library(tmp_path / "data", EmbedderSlot("words", WordEmbedder))
    first.add_folder("logs", folder)
    [view] = settled(first)
    first.close()
    other = WordEmbedder("other words", delay=0.2)
    again = Library(tmp_path / "data", EmbedderSlot("other words", lambda: other))
    states = set()
    deadline = time.time() + 60
    while not states or any(v.busy for v in again.listing()):
        states |= {v.state for v in again.listing()}
        assert time.time() < deadline, states
        time.sleep(0.05)
    assert any(state.startswith("embedding again with other words") for state in states), states
    assert len(other.seen) == view.passages
    again.close()



def test_an_index_the_indexer_cannot_open_fails_that_job_in_words_and_the_next_try_works(tmp_path, folder,
                                                                                          monkeypatch):
    """The indexing thread's own connection fails to open (another program holds the file, a full disk): the
    collection's indexing ends saying why instead of waiting forever, and a later Refresh indexes it."""
    library = Library(tmp_path / "data", EmbedderSlot("words", WordEmbedder))
    library.index  # the reader's connection opens as usual
    real, tries = Library._open, []

    def flaky(self):
        tries.append(1)
        if len(tries) == 1:
            raise UserError("the documents index cannot be opened (disk I/O error)")
        return real(self)

    monkeypatch.setattr(Library, "_open", flaky)
    library.add_folder("logs", folder)
    [view] = settled(library)
    assert view.state == "indexing stopped: the documents index cannot be opened (disk I/O error)"
    library.refresh("logs")
    [view] = settled(library)
    assert view.passages > 0 and view.state.startswith("5 files: 4 read")
    library.close()
