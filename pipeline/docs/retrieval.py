"""A question → the passages of a collection that answer it, numbered, as many as fit the chat model's room:
BM25 (the words) and the embedder's nearest vectors (the meaning) each rank the passages, and reciprocal rank
fusion (Cormack et al. 2009: Σ weight/(k + rank)) joins the two lists without scaling their scores; passages found
next to each other on one page of a file become one source. A cross-encoder reranker, where one is given,
reorders the first of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from pipeline.docs.index import Hit, Index
from pipeline.embed.embedder import Embedder

# The fusion's constant and the meaning's weight, chosen on the 51 questions of tests/test_docs_retrieval.py and
# checked on 24 others over 20 other modules (bench/docs_recall.py): with two short lists a small k lets a passage
# either ranking puts first count (the paper's 60 suits many long ones), and the vectors find a question put in
# other words than the document's (recall@5 0.88 → 0.92; held out: 0.88 → 0.92)
RRF_K = 5
WEIGHTS = (1.0, 1.5)  # BM25, vectors
CANDIDATES = 40  # from each ranking
RERANKED = 20  # of the fused ranking, reordered by a reranker where there is one
Rerank = Callable[[str, list[str]], np.ndarray]  # (question, passages) → a score a passage


@dataclasses.dataclass(frozen=True)
class Source:
    """A numbered source given to the model: a file's passage(s) and where they are."""

    number: int
    file: str
    file_id: int
    text: str
    start: int
    end: int
    page: int | None
    heading: str | None
    passages: tuple[int, ...]  # the passage ids joined in it

    @property
    def where(self) -> str:
        """"guide.pdf, page 3" or "README.md › Install"."""
        return self.file + (f", page {self.page}" if self.page else "") + (f" › {self.heading}" if self.heading else "")


def fuse(rankings: list[list[int]], weights: tuple[float, ...] = WEIGHTS, k: int = RRF_K) -> list[int]:
    """Ids by weighted reciprocal rank fusion of `rankings` (each best first)."""
    scores: dict[int, float] = {}
    for ranking, weight in zip(rankings, weights):
        for rank, pid in enumerate(ranking):
            scores[pid] = scores.get(pid, 0.0) + weight / (k + rank + 1)
    return sorted(scores, key=lambda pid: -scores[pid])


def ranked(index: Index, embedder: Embedder, collection: str, question: str, k: int = CANDIDATES,
           rerank: Rerank | None = None) -> list[Hit]:
    """The collection's passages for `question`, best first (the first `RERANKED` reordered by `rerank`)."""
    cid = index.collection(collection)
    vector = embedder.encode([question], prompt="query")[0]
    hits = index.hits(fuse([index.keyword_search(cid, question, k), index.vector_search(cid, vector, k)]))
    if rerank is None or not hits:
        return hits
    scores = rerank(question, [hit.text for hit in hits[:RERANKED]])
    return [hits[i] for i in np.argsort(-scores, kind="stable")] + hits[RERANKED:]


def retrieve(index: Index, embedder: Embedder, collection: str, question: str, budget: int,
             count: Callable[[str], int], rerank: Rerank | None = None) -> list[Source]:
    """Numbered sources for `question`, best first, whose texts take at most `budget` tokens of the chat model
    (`count`); a passage next to one already taken (on its page) is joined to it."""
    taken: list[list[Hit]] = []  # runs of adjacent passages of one file
    used = 0
    for hit in ranked(index, embedder, collection, question, rerank=rerank):
        tokens = count(hit.text)
        if used + tokens > budget:
            if used:
                break
            continue  # a first passage over the budget alone: try the next
        run = next((r for r in taken if (r[0].file, r[0].page) == (hit.file, hit.page)  # a source is on one page
                    and hit.seq in (r[0].seq - 1, r[-1].seq + 1)), None)
        if run is None:
            taken.append([hit])
        elif hit.seq < run[0].seq:
            run.insert(0, hit)
        else:
            run.append(hit)
        used += tokens
    return [_source(n + 1, run) for n, run in enumerate(taken)]


def _source(number: int, run: list[Hit]) -> Source:
    """Adjacent passages as one text: each one's part beyond the one before (they overlap by construction)."""
    text, end = run[0].text, run[0].end
    for hit in run[1:]:
        text += hit.text[max(end - hit.start, 0):] if hit.start < end else "\n" + hit.text
        end = hit.end
    return Source(number, run[0].file, run[0].file_id, text, run[0].start, end, run[0].page, run[0].heading,
                  tuple(h.id for h in run))
