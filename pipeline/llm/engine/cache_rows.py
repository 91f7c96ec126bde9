"""CacheRows: the static KV cache's rows, what each holds, and finding a prompt's cached prefix by content.

Why rows, not pages: a static cache (gpt-fast) lets a decode step read the cache as a plain view
and replay one CUDA graph. So running requests always occupy rows 0..B-1 (`swap` keeps them there),
and a row keeps its tokens after its reply, so the next turn of that conversation, whoever sends it
(the UI, an API client resending the whole conversation, the terminal chat), prefills only what is new.

Prefixes are found by content, as vLLM finds cached blocks: a row's positions are hashed in blocks of
BLOCK, each hash chained over the ones before it (an image slot's positions are its image's hash and
offset, so an image counts as content too), and an index maps block hashes to the rows holding them.
A prompt's hashes are looked up until none matches; the row found is then checked position by
position, so a hash collision can cost a prefill but never give wrong tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.weights.config import DecoderConfig

BLOCK = 16  # positions per hashed block


def block_hashes(sig: Sequence) -> list[int]:
    """The chained hash of each whole block of `sig` (a prompt's `signature()`)."""
    out, h = [], 0
    for start in range(0, len(sig) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(sig[start:start + BLOCK])))
        out.append(h)
    return out


def common_prefix(a: Sequence, b: Sequence) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclasses.dataclass(eq=False)
class Row:
    """What a cache row holds: the signature of its tokens, their block hashes, the rotary table they
    were written with, and whose session put them there (a tie-break hint)."""

    session: str | None = None
    held: list = dataclasses.field(default_factory=list)
    hashes: list[int] = dataclasses.field(default_factory=list)
    table: int = 0
    last_used: float = 0.0
    written: int = 0  # positions written so far, a step in flight included (what a move must copy)


class CacheRows:
    """The KV cache, the penalties' per-row state (`seen`: the repetition mask, prompt included;
    `counts`: how often the reply used each token) and the rows' contents."""

    def __init__(self, config: DecoderConfig, rows: int, positions: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.kv = KVCache(config, rows, positions, dtype, device)
        self.seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        self.rows = [Row() for _ in range(rows)]
        self._index: dict[int, set[Row]] = {}  # block hash → the rows holding that block (at that place)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Row:
        return self.rows[i]

    # ---- content ------------------------------------------------------------------------------

    def hold(self, i: int, sig: list, table: int, session: str | None) -> None:
        """Row `i` now holds `sig` (written with rotary `table`)."""
        row = self.rows[i]
        self._unindex(row)
        row.held, row.table, row.session = list(sig), table, session
        row.hashes = block_hashes(row.held)
        for h in row.hashes:
            self._index.setdefault(h, set()).add(row)

    def append(self, i: int, token: int) -> None:
        """A token the row's request fed back: indexed once its block is whole."""
        row = self.rows[i]
        row.held.append(token)
        if len(row.held) % BLOCK == 0:
            h = hash((row.hashes[-1] if row.hashes else 0, tuple(row.held[-BLOCK:])))
            row.hashes.append(h)
            self._index.setdefault(h, set()).add(row)

    def forget(self, i: int) -> None:
        """Row `i` holds nothing usable (an error left it unknown, or it is evicted)."""
        self._unindex(self.rows[i])
        self.rows[i] = Row()

    def _unindex(self, row: Row) -> None:
        for h in row.hashes:
            holders = self._index.get(h)
            if holders is not None:
                holders.discard(row)
                if not holders:
                    del self._index[h]
        row.hashes = []

    # ---- placement ----------------------------------------------------------------------------

    def claim(self, sig: list, table: int, session: str | None, first_idle: int) -> tuple[int, int]:
        """The row a joining request runs in, moved to `first_idle` (just after the running rows), and
        how many of its first positions that row already holds: the idle row holding the longest
        prefix of `sig` (the request's own session's row first among equals), else an empty row,
        else the least recently used idle row (evicted)."""
        idle = {id(self.rows[i]): i for i in range(first_idle, len(self.rows))}
        found: list[int] = []
        for h in block_hashes(sig):  # the rows holding every block so far
            holders = [idle[id(r)] for r in self._index.get(h, ()) if id(r) in idle and r.table == table]
            if not holders:
                break
            found = holders
        candidates = found or [i for i in idle.values() if self.rows[i].table == table and self.rows[i].held]

        def shared(i: int) -> int:  # whole blocks matched by hash; the exact count includes a partial block
            return common_prefix(self.rows[i].held, sig)

        best = max(candidates, key=lambda i: (shared(i), session is not None and self.rows[i].session == session),
                   default=-1)
        held = shared(best) if best >= 0 else 0
        if held == 0:
            empty = [i for i in idle.values() if not self.rows[i].held]
            best = (empty or [min(idle.values(), key=lambda i: self.rows[i].last_used)])[0]
            self.forget(best)
        self.swap(best, first_idle)
        return first_idle, held

    def swap(self, a: int, b: int) -> None:
        """Exchange two rows: their cache entries, penalty state and contents."""
        if a == b:
            return
        self.kv.swap_rows(a, b, max(self.rows[a].written, self.rows[b].written))
        for t in (self.seen, self.counts):  # by slices: no index list to upload (that would wait for the GPU)
            held = t[a].clone()
            t[a] = t[b]
            t[b] = held
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]

    def release(self, i: int) -> None:
        """Row `i`'s request ended: it keeps its tokens for whoever continues them."""
        self.rows[i].last_used = time.perf_counter()
