"""Scheduler: which requests wait, which run, and in which cache rows.

Continuous batching as in vLLM and TensorRT-LLM's executor: up to `max_batch` requests run; new ones
join between decode steps, and finished or cancelled ones leave at once. Running requests always
occupy cache rows 0..B-1 (a joining request's row is moved to B, a leaving one's swapped with the
last), so a decode step reads the cache as a plain view. The engine thread alone changes the running
set; any thread may add a request.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

from pipeline.errors import UserError
from pipeline.llm.cache_rows import CacheRows
from pipeline.llm.grammar import Grammar
from pipeline.llm.sampling import Draws, SamplingParams

if TYPE_CHECKING:
    from torch import Tensor

    from pipeline.llm.engine import Prompt, TokenStream


@dataclasses.dataclass(eq=False)
class Request:
    """A request inside the engine: what was asked, where it runs, and its next input."""

    prompt: Prompt
    params: SamplingParams
    stop_ids: set[int]
    session: str | None
    stream: TokenStream
    draws: Draws
    submitted: float
    grammar: Grammar | None = None  # the tokens it may draw (structured output)
    bias: Tensor | None = None  # its logit_bias as one row over the vocabulary, on the device (made at admission)
    row: int = -1
    position: int = 0  # where the next fed token goes in the cache
    table: int = 0  # rotary table (Qwen v1 dynamic NTK)
    last_token: int = 0
    first_token_at: float = 0.0


class Scheduler:
    def __init__(self, max_batch: int, rows: CacheRows):
        self.max_batch, self.rows = max_batch, rows
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # running[i] runs in cache row i
        self._wake = threading.Condition()
        self._closed = False

    def add(self, request: Request) -> None:
        """Queue a request (any thread)."""
        with self._wake:
            if self._closed:
                raise UserError("the language model was unloaded; reload the page")
            self.waiting.append(request)
            self._wake.notify()

    def close(self) -> None:
        """No more requests; the engine thread's `next_joining` returns None."""
        with self._wake:
            self._closed = True
            self._wake.notify()

    def next_joining(self) -> list[Request] | None:
        """The waiting requests that fit the batch now (waits while there is nothing to do); None once closed."""
        with self._wake:
            while not self._closed and not self.waiting and not self.running:
                self._wake.wait()
            if self._closed:
                return None
            room = self.max_batch - len(self.running)
            joining, self.waiting = self.waiting[:room], self.waiting[room:]
            return joining

    def place(self, request: Request, sig: list) -> int:
        """Run `request` in the row after the running ones that holds the longest cached prefix of its
        signature `sig`; how many positions that row already holds."""
        row, reused = self.rows.claim(sig, request.table, request.session, len(self.running))
        request.row = row
        self.running.append(request)
        return reused

    def leave(self, request: Request, error: bool) -> None:
        """`request` stops running; its row keeps its tokens (forgotten after an `error`: unknown)."""
        if request.row < 0 or request not in self.running:
            return
        i, last = request.row, len(self.running) - 1
        if error:
            self.rows.forget(i)
        self.rows.release(i)
        self.rows.swap(i, last)
        moved = self.running[last]
        self.running[i], moved.row = moved, i
        self.running.pop()
        request.row = -1

    def drop_all(self) -> list[Request]:
        """Every request still waiting or running (the engine closes)."""
        with self._wake:
            left, self.waiting = self.running + self.waiting, []
        return left

    def status(self) -> dict[str, int]:
        return {"running": len(self.running), "queued": len(self.waiting), "max_batch": self.max_batch,
                "cache_rows": len(self.rows)}
