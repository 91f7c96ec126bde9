"""Retrieval quality, recall@5: the 51 questions of tests/test_docs_retrieval.py over pydoc's text of 20 standard
modules, and 24 questions held out from choosing the fusion's constants, over 20 other modules; each ranked by BM25
alone, the vectors alone, the fusion at the paper's constants (k = 60, equal weights) and at ours
(`pipeline/docs/retrieval.py`), all on the same index in one run.

    python bench/docs_recall.py
Writes docs_recall.json to $OUT (default bench/results); prints a table last.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from test_docs_retrieval import QUESTIONS  # noqa: E402
from timing import report  # noqa: E402
from pipeline.docs.index import Index  # noqa: E402
from pipeline.docs.indexer import Indexer  # noqa: E402
from pipeline.docs.retrieval import CANDIDATES, fuse  # noqa: E402
from pipeline.embed.embedder import Embedder, built_in_folder  # noqa: E402

HELD_OUT = [  # (question, module, a word of the answering passage)
    ("How do I make a temporary file that is deleted when closed?", "tempfile", "TemporaryFile"),
    ("How do I create a temporary directory?", "tempfile", "mkdtemp"),
    ("How do I find all path names matching a shell pattern?", "glob", "glob"),
    ("How do I compute the SHA-256 digest of some bytes?", "hashlib", "sha256"),
    ("How do I make a deep copy of an object?", "copy", "deepcopy"),
    ("How do I define an enumeration whose members are integers?", "enum", "IntEnum"),
    ("How do I give each enum member an automatic value?", "enum", "auto"),
    ("How do I turn a dataclass instance into a dictionary?", "dataclasses", "asdict"),
    ("How do I declare a field of a dataclass with a default factory?", "dataclasses", "field"),
    ("How do I split a URL into its components?", "urllib.parse", "urlsplit"),
    ("How do I percent-encode a string for use in a URL?", "urllib.parse", "quote"),
    ("How do I encode bytes as base64?", "base64", "b64encode"),
    ("How do I generate a random UUID?", "uuid", "uuid4"),
    ("How do I compute the greatest common divisor of two integers?", "math", "gcd"),
    ("How do I check if two floating point numbers are close to each other?", "math", "isclose"),
    ("How do I get an item getter function for use as a sort key?", "operator", "itemgetter"),
    ("How do I compress data with gzip?", "gzip", "compress"),
    ("How do I pause the program for some seconds?", "time", "sleep"),
    ("How do I measure elapsed time with a monotonic clock?", "time", "monotonic"),
    ("How do I check whether a year is a leap year?", "calendar", "isleap"),
    ("How do I compare two sequences of lines and show the differences?", "difflib", "unified_diff"),
    ("How do I find close matches to a word in a list of words?", "difflib", "get_close_matches"),
    ("How do I save a Python object to a file with pickle?", "pickle", "dump"),
    ("How do I capitalize every word of a string?", "string", "capwords"),
]
RANKINGS = {"bm25": lambda kw, vec: kw, "vectors": lambda kw, vec: vec,
            "fusion k=60, equal weights": lambda kw, vec: fuse([kw, vec], (1.0, 1.0), 60),
            "fusion, ours": lambda kw, vec: fuse([kw, vec])}


def recall(name: str, questions: list[tuple[str, str, str]], embedder: Embedder, work: Path) -> dict[str, float]:
    folder = work / name
    folder.mkdir()
    for module in sorted({m for _, m, _ in questions}):  # as `python -m pydoc` prints it in a fresh interpreter
        text = subprocess.run([sys.executable, "-I", "-m", "pydoc", module], capture_output=True, text=True,
                              check=True, env={"PAGER": "cat", "TERM": "dumb"}).stdout
        (folder / f"{module}.txt").write_text(re.sub(r" at 0x[0-9a-f]+", "", text))
    index = Index(work / f"{name}.db", embedder.name, embedder.dim)
    index.add_collection(name, str(folder))
    Indexer(index, embedder).refresh(name, folder)
    cid, found = index.collection(name), dict.fromkeys(RANKINGS, 0)
    for question, module, word in questions:
        kw = index.keyword_search(cid, question, CANDIDATES)
        vec = index.vector_search(cid, embedder.encode([question], prompt="query")[0], CANDIDATES)
        for ranking, rank in RANKINGS.items():
            top = index.hits(rank(kw, vec)[:5])
            found[ranking] += any(h.file == f"{module}.txt" and word.lower() in h.text.lower() for h in top)
    index.close()
    return {ranking: round(n / len(questions), 3) for ranking, n in found.items()}


def main() -> None:
    embedder = Embedder(built_in_folder(), "all-MiniLM-L6-v2")
    res = {"date": time.strftime("%Y-%m-%d"), "embedder": embedder.name}
    with tempfile.TemporaryDirectory() as work:
        for name, questions in (("test set (51)", QUESTIONS), ("held out (24)", HELD_OUT)):
            for ranking, value in recall(name.split()[0], questions, embedder, Path(work)).items():
                res[f"{name}: recall@5, {ranking}"] = value
    report("docs_recall", res)


if __name__ == "__main__":
    main()
