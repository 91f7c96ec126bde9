"""A collection's vectors in memory, searched by matrix products, kept up to date by what changed.

Reading a million vectors out of SQLite takes about 15 s on a 2-core CPU; a question must not wait for that
after each file the indexer writes. So the cache reads them all once, then, when the collection's `generation`
moved on, only what changed: the passages removed since (`vectors_removed`, a log the index's trigger writes),
whose rows are marked dead, and the rows added since (ids past the highest one read, or re-written ones), appended
as another block. A log pruned past what a cache holds makes it read everything again. The indexing thread brings
a collection's vectors up to date after each refresh (`update`), so the first question after a start or a large
change does not wait for the read; a question arriving meanwhile waits for that read instead of making its own.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable

import numpy as np

Rows = Iterable[tuple[int, bytes]]  # (passage id, float32 vector bytes)


@dataclasses.dataclass
class Block:
    ids: np.ndarray  # int64 [n]
    matrix: np.ndarray  # float32 [n, dim], rows of unit length
    alive: np.ndarray  # bool [n]: False once the passage is removed or re-written

    @classmethod
    def of(cls, rows: Rows) -> Block:
        found = list(rows)
        ids = np.fromiter((pid for pid, _ in found), np.int64, len(found))
        matrix = np.frombuffer(b"".join(blob for _, blob in found), np.float32).reshape(len(found), -1).copy() \
            if found else np.zeros((0, 0), np.float32)
        matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
        return cls(ids, matrix, np.ones(len(found), bool))


@dataclasses.dataclass
class Held:
    generation: int
    top: int  # the highest passage id read
    blocks: list[Block]


@dataclasses.dataclass(frozen=True)
class Source:
    """How the cache reads a collection from the index."""

    state: Callable[[], tuple[int, int]]  # (generation, pruned: the newest generation the removal log lost)
    everything: Callable[[], Rows]
    removed_since: Callable[[int], list[int]]  # passage ids removed after a generation
    added: Callable[[int, int], Rows]  # rows past an id, or re-written after a generation


MOST_BLOCKS = 8  # then the live rows are joined into one block again


class VectorCache:
    """Shared by the index's connections (the questions' and the indexing thread's): one copy of each collection."""

    def __init__(self):
        self._held: dict[int, Held] = {}
        self._lock = threading.Lock()  # one reader of changes at a time; searches run outside it

    def update(self, collection: int, source: Source) -> None:
        """Read what changed in `collection` since it was last read (everything, the first time)."""
        with self._lock:
            self._current(collection, source)

    def search(self, collection: int, source: Source, vector: np.ndarray, k: int) -> list[int]:
        """The ids of the `k` vectors of `collection` nearest to `vector` by cosine, best first."""
        with self._lock:
            held = self._current(collection, source)
        query = np.asarray(vector, np.float32)
        ids, scores = [], []
        for block in held.blocks:
            if len(block.ids):
                found = block.matrix @ query
                found[~block.alive] = -np.inf
                ids.append(block.ids)
                scores.append(found)
        if not ids:
            return []
        ids, scores = np.concatenate(ids), np.concatenate(scores)
        best = np.argpartition(-scores, k - 1)[:k] if len(ids) > k else np.arange(len(ids))
        best = best[np.lexsort((ids[best], -scores[best]))]  # ties by id: the same order however the rows lie
        return [int(i) for i, s in zip(ids[best], scores[best]) if s > -np.inf]

    def _current(self, collection: int, source: Source) -> Held:
        generation, pruned = source.state()
        held = self._held.get(collection)
        if held is not None and held.generation == generation:
            return held
        removed = source.removed_since(held.generation) if held is not None and held.generation >= pruned else None
        if removed is None or len(removed) > sum(len(b.ids) for b in held.blocks) // 2:  # new, or mostly rewritten
            block = Block.of(source.everything())
            held = Held(generation, int(block.ids.max()) if len(block.ids) else 0, [block])
        else:
            gone = np.array(sorted(set(removed)), np.int64)
            for block in held.blocks:
                block.alive &= ~np.isin(block.ids, gone)
            added = Block.of(source.added(held.top, held.generation))
            blocks = [b for b in held.blocks if b.alive.any()] + ([added] if len(added.ids) else [])
            if len(blocks) > MOST_BLOCKS:
                blocks = [Block(np.concatenate([b.ids[b.alive] for b in blocks]),
                                np.concatenate([b.matrix[b.alive] for b in blocks]),
                                np.ones(sum(int(b.alive.sum()) for b in blocks), bool))]
            held = Held(generation, max([held.top, *added.ids.tolist()]), blocks)
        self._held[collection] = held
        return held
