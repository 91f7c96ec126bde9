"""The documents index (issue 51) on this machine, the reference in the same run:

  embed    our all-MiniLM-L6-v2 (`pipeline/embed/`) against sentence-transformers' `encode` on the same 2,000
           passages (Python's documentation, split as the indexer splits it), passages/s, and the cosine between
           the two
  index    indexing a folder of PDFs (fpdf2 pages of Python's documentation, `--pages`): pages/s from files to a
           searchable index, and the peak resident memory while indexing (sampled)
  query    query latency at `--sizes` passages (synthetic words and unit vectors, as many as a 10k-page to
           1M-passage collection): BM25, vector KNN (bits scanned, the best rescored in float32) and the fused
           ranking, median of 20 queries each; and how many of the exact 40 nearest (numpy over every float32
           vector) the vector search finds (random vectors: binary codes' worst case)

    python bench/docs_index.py --parts embed,index,query --pages 500 --sizes 10000,100000,1000000
Writes docs_index.json to $OUT (default bench/results); prints a table last.
"""

from __future__ import annotations

import argparse
import importlib
import pydoc
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from timing import report  # noqa: E402
from pipeline.docs.chunking import passages  # noqa: E402
from pipeline.docs.index import Index  # noqa: E402
from pipeline.docs.indexer import Indexer  # noqa: E402
from pipeline.docs.readers import read_document  # noqa: E402
from pipeline.docs.retrieval import ranked  # noqa: E402
from pipeline.embed.embedder import Embedder, built_in_folder  # noqa: E402

MODULES = ["json", "csv", "argparse", "logging", "pathlib", "subprocess", "threading", "sqlite3", "collections",
           "itertools", "functools", "datetime", "re", "zipfile", "shutil", "textwrap", "heapq", "bisect",
           "statistics", "random", "email", "http.client", "unittest", "asyncio", "typing", "inspect"]


def python_docs(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name in MODULES:
        text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        path = folder / f"{name}.txt"
        path.write_text(re.sub(r" at 0x[0-9a-f]+", "", text))
        out.append(path)
    return out


def embed_part(res: dict, embedder: Embedder, work: Path) -> None:
    from sentence_transformers import SentenceTransformer

    texts = [p.text for f in python_docs(work / "txt") for p in passages(
        read_document(f), lambda t: embedder.count_tokens(t) - 2, embedder.max_tokens - 2, 38)][:2000]
    theirs_model = SentenceTransformer(str(embedder.folder), device=str(embedder.device))
    timings = {"ours": [], "sentence-transformers": []}
    for _ in range(2):  # interleaved
        start = time.perf_counter()
        ours = embedder.encode(texts)
        timings["ours"].append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs = theirs_model.encode(texts, batch_size=32)
        timings["sentence-transformers"].append(time.perf_counter() - start)
    for name, seconds in timings.items():
        res[f"embed: {name} passages/s"] = round(len(texts) / min(seconds), 1)
    res["embed: passages"] = len(texts)
    res["embed: ours ÷ sentence-transformers"] = round(min(timings["sentence-transformers"]) / min(timings["ours"]), 3)
    res["embed: worst cosine"] = float(np.min((ours * theirs).sum(1) / np.linalg.norm(theirs, axis=1)))


def pdf_folder(folder: Path, pages: int) -> Path:
    """`pages` pages of Python's documentation as PDFs written by fpdf2, one file per module (as many as needed)."""
    import fpdf

    texts = [f.read_text() for f in python_docs(folder / "txt")]
    lines = [line for text in texts for line in text.splitlines()]
    per_page, at, written = 45, 0, 0
    out = folder / "pdf"
    out.mkdir(parents=True, exist_ok=True)
    while written < pages:
        pdf = fpdf.FPDF()
        pdf.set_font("helvetica", size=9)
        for _ in range(min(50, pages - written)):
            pdf.add_page()
            page = lines[at % len(lines):at % len(lines) + per_page]
            at += per_page
            pdf.multi_cell(0, 5, "\n".join(page).encode("latin-1", "replace").decode("latin-1"))
            written += 1
        pdf.output(str(out / f"part{written:05d}.pdf"))
    return out


def index_part(res: dict, embedder: Embedder, work: Path, pages: int) -> None:
    folder = pdf_folder(work, pages)
    index = Index(work / "index" / "index.db", embedder.name, embedder.dim)
    index.add_collection("bench", str(folder))
    process, peak, done = psutil.Process(), [0], threading.Event()
    base = process.memory_info().rss

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    summary = Indexer(index, embedder).refresh("bench", folder)
    seconds = time.perf_counter() - start
    done.set()
    res["index: pages"] = summary.pages
    res["index: passages"] = index.db.execute("SELECT count(*) FROM passages").fetchone()[0]
    res["index: pages/s"] = round(summary.pages / seconds, 2)
    res["index: seconds"] = round(seconds, 1)
    res["index: peak resident MB while indexing (growth)"] = round((peak[0] - base) / 1e6, 1)
    res["index: peak resident MB (the whole process)"] = round(peak[0] / 1e6, 1)
    if torch.cuda.is_available():
        res["index: peak GPU memory MB"] = round(torch.cuda.max_memory_allocated() / 1e6, 1)
    res["index: database MB"] = round(sum(p.stat().st_size for p in (work / "index").iterdir()) / 1e6, 1)


def synthetic_index(path: Path, size: int, dim: int, rng: np.random.Generator) -> tuple[Index, np.ndarray]:
    """`size` passages of 60 words drawn from a 20,000-word vocabulary (Zipf-like), unit vectors at random; and
    those vectors (row i: passage id i + 1)."""
    from pipeline.docs.chunking import Passage

    index = Index(path, "synthetic", dim)
    cid = index.add_collection("bench", None)
    words = np.array([f"w{i}" for i in range(20000)])
    per_file, every = 1000, np.empty((size, dim), np.float32)
    for first in range(0, size, per_file):
        n = min(per_file, size - first)
        picks = np.minimum(rng.zipf(1.3, (n, 60)) - 1, 19999)
        texts = [" ".join(words[row]) for row in picks]
        vectors = rng.standard_normal((n, dim)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        every[first:first + n] = vectors
        index.replace_file(cid, f"file{first}", str(first), 0, 1, [Passage(t, 0, len(t), None, None) for t in texts],
                           vectors)
    return index, every


class RandomQueries:
    """A stand-in embedder for the synthetic index: a unit vector per query."""

    def __init__(self, dim: int, rng: np.random.Generator):
        self.dim, self.rng = dim, rng

    def encode(self, texts: list[str], prompt: str | None = None) -> np.ndarray:
        v = self.rng.standard_normal((len(texts), self.dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


def query_part(res: dict, work: Path, sizes: list[int], dim: int = 384) -> None:
    rng = np.random.default_rng(0)
    for size in sizes:
        start = time.perf_counter()
        index, every = synthetic_index(work / f"synthetic{size}.db", size, dim, rng)
        res[f"query@{size}: build s"] = round(time.perf_counter() - start, 1)
        cid = index.collection("bench")
        queries = [f"w{a} w{b} w{c} w{d}" for a, b, c, d in rng.integers(0, 2000, (20, 4))]
        embed = RandomQueries(dim, rng)
        for name, run in (("bm25", lambda q: index.keyword_search(cid, q, 40)),
                          ("vector", lambda q: index.vector_search(cid, embed.encode([q])[0], 40)),
                          ("fused", lambda q: ranked(index, embed, "bench", q))):
            start = time.perf_counter()
            run(queries[0])  # the first: the vector search reads the collection's vectors into memory
            res[f"query@{size}: {name} first ms"] = round((time.perf_counter() - start) * 1e3, 1)
            times = []
            for q in queries:
                start = time.perf_counter()
                run(q)
                times.append(time.perf_counter() - start)
            res[f"query@{size}: {name} ms (median of {len(queries)})"] = round(statistics.median(times) * 1e3, 2)
        from pipeline.docs.chunking import Passage  # a file of 1,000 passages written again, as a refresh would

        texts = [f"changed passage {i} w1 w2 w3" for i in range(1000)]
        fresh = rng.standard_normal((1000, dim)).astype(np.float32)
        fresh /= np.linalg.norm(fresh, axis=1, keepdims=True)
        index.replace_file(cid, "file0", "changed", 0, 1, [Passage(t, 0, len(t), None, None) for t in texts], fresh)
        every[:1000] = fresh
        start = time.perf_counter()
        index.vector_search(cid, embed.encode(queries[:1])[0], 40)
        res[f"query@{size}: vector ms, the first after 1,000 passages changed"] = round(
            (time.perf_counter() - start) * 1e3, 1)
        ids = np.concatenate([np.arange(1000, size) + 1, np.arange(size + 1, size + 1001)])  # file0's new ids
        every = np.concatenate([every[1000:], fresh])
        found = []
        for vector in embed.encode(queries):
            exact = set(ids[np.argsort(-(every @ vector))[:40]].tolist())
            found.append(len(exact & set(index.vector_search(cid, vector, 40))) / 40)
        res[f"query@{size}: exact 40 nearest found"] = round(float(np.mean(found)), 3)
        index.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="embed,index,query")
    parser.add_argument("--pages", type=int, default=500)
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--folder", type=Path, help="all-MiniLM-L6-v2's folder (default: the installed package's)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else
           f"CPU, {psutil.cpu_count(logical=False)} cores", "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__}
    embedder = Embedder(args.folder or built_in_folder(), "all-MiniLM-L6-v2", device)
    with tempfile.TemporaryDirectory() as work:
        for part in args.parts.split(","):
            {"embed": lambda: embed_part(res, embedder, Path(work)),
             "index": lambda: index_part(res, embedder, Path(work), args.pages),
             "query": lambda: query_part(res, Path(work), [int(s) for s in args.sizes.split(",")])}[part]()
            report("docs_index", res)


if __name__ == "__main__":
    main()
