"""Scheduler: which requests wait, which read their prompts, which run, and in which cache rows.

Continuous batching as in vLLM and TensorRT-LLM's executor: up to `max_batch` requests hold a row; new
ones join between decode steps, and finished or cancelled ones leave at once. A joining request
first reads its prompt, in chunks (vLLM's chunked prefill): while requests run, each engine step has a
budget of `step_tokens` positions, one for each running request's decode and the rest for prompt chunks
of the requests reading theirs, shared fairly (`chunks`), so a long prompt stalls neither the running
chats nor a short prompt that joins after it. Rows are kept in one order: running requests in rows 0..R-1 (so a
decode step reads the cache as a plain view), then the requests reading their prompts; a joining
request's row is moved to the first free place, a request whose prompt is read moves to row R, and
a leaving one's row is swapped out of the block. The engine thread alone changes the rows; any
thread may add a request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pipeline.errors import UserError
from pipeline.llm.engine.cache_rows import CacheRows
from pipeline.llm.engine.plan import Request, Scheduled, StepPlan
from pipeline.llm.engine.proposer import Proposer
from pipeline.llm.engine.speculation import DRAFT_SIZES


class Scheduler:
    """`step_tokens`: each step's budget while requests run; `lone_tokens`: while none runs. None: no
    budget, a prompt is read whole in one step. `proposer`: where the running requests' drafts come from
    (speculative decoding; None: no drafts)."""

    def __init__(self, max_batch: int, rows: CacheRows, step_tokens: int | None = None,
                 lone_tokens: int | None = None, proposer: Proposer | None = None):
        self.max_batch, self.rows, self.proposer = max_batch, rows, proposer
        self.step_tokens, self.lone_tokens = step_tokens or None, lone_tokens or None
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # running[i] runs in cache row i
        self.prefilling: list[Request] = []  # prefilling[j] reads its prompt in row len(running) + j
        self._wake = threading.Condition()
        self._closed = False
        self.most_held = 0  # the most requests that have held rows at once (a batch seen, whatever the polling)

    def add(self, request: Request) -> None:
        """Queue a request (any thread); where drafts are proposed, it gets its drafting state."""
        if self.proposer is not None:
            request.draft = self.proposer.state()
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
            while not self._closed and not self.waiting and not self.running and not self.prefilling:
                self._wake.wait()
            if self._closed:
                return None
            room = self.max_batch - len(self.running) - len(self.prefilling)
            joining, self.waiting = self.waiting[:room], self.waiting[room:]
            return joining

    def place(self, request: Request, sig: list) -> int:
        """Give `request` (its prompt's signature `sig`) the first free row, taking the idle row that
        holds the longest cached prefix of `sig`; how many positions that row already holds."""
        first_free = len(self.running) + len(self.prefilling)
        row, reused = self.rows.claim(sig, request.table, request.session, first_free)
        request.row, request.sig = row, sig
        self.prefilling.append(request)
        self.most_held = max(self.most_held, len(self.running) + len(self.prefilling))
        return reused

    def plan(self, in_flight: bool, settle: Callable[[], None]) -> StepPlan:
        """This step: each running request's last token (the step in flight drew it, on the device, where
        `in_flight`) and its draft, padded to a draft size, and the prompt chunks the budget leaves room for.
        Drafts continue the last tokens, so where one may come the step in flight is settled first (`settle`);
        none is proposed while a prompt is read (its chunk rides along)."""
        drafts = None
        if self.proposer is not None and self.running and not any(r.position < len(r.sig) for r in self.prefilling):
            wanted = self.proposer.wanted(self.running)
            if any(wanted.values()) and (not in_flight or self.proposer.may_find(wanted, self.rows)):
                if in_flight:
                    settle()
                    in_flight = False
                drafts = self.proposer.drafts(self.running, wanted, self.rows)
        drafts = drafts or [[]] * len(self.running)
        width = next(k for k in (0, *DRAFT_SIZES) if k >= max(map(len, drafts), default=0))
        rows = tuple(Scheduled(r, r.position, 1 + len(d), tuple(d), in_flight, width=1 + width)
                     for r, d in zip(self.running, drafts))
        chunks = tuple(Scheduled(r, r.position, end - r.position, last=end == len(r.sig))
                       for r, end in self.chunks(sum(map(len, drafts))))
        return StepPlan(rows, chunks)

    def chunks(self, drafted: int = 0) -> list[tuple[Request, int]]:
        """This step's prompt chunks, as (request, the position its chunk ends at), in row order. The budget:
        while requests run, `step_tokens` less one position per running request and the `drafted` tokens
        they check (at least one, so that prompts always advance); with none running, `lone_tokens`. It is
        shared fairly among the prompts being read: each gets an equal part, and what a short one leaves
        goes to the others (water-filling). So a short prompt that joins while a long one is read gets its
        first token after a step or two, not after the long one's whole prefill. No budget (None): prompts
        are read whole (for comparison)."""
        reading = [r for r in self.prefilling if r.position < len(r.sig)]  # not those whose first token is drawn
        budget = (self.step_tokens - len(self.running) - drafted if self.step_tokens else None) if self.running \
            else self.lone_tokens
        if budget is None:
            return [(r, len(r.sig)) for r in reading]
        room = max(budget, 1)
        left = sorted(reading, key=lambda r: len(r.sig) - r.position)
        ends: dict[Request, int] = {}
        for i, r in enumerate(left):
            if room == 0:
                break
            take = min(len(r.sig) - r.position, max(room // (len(left) - i), 1))
            ends[r] = r.position + take
            room -= take
        return [(r, ends[r]) for r in self.prefilling if r in ends]

    def promote(self, request: Request) -> None:
        """`request` has read its prompt: it joins the running requests, in row len(running)."""
        j, first = self.prefilling.index(request), len(self.running)
        self._exchange(self.prefilling, 0, j, first)
        self.running.append(self.prefilling.pop(0))

    def leave(self, request: Request, error: bool) -> None:
        """`request` stops: its row keeps its tokens (what it read of its prompt, for one still reading it;
        forgotten after an `error`: unknown) and leaves the block of rows in use."""
        if request in self.running:
            block, first = self.running, 0
        elif request in self.prefilling:
            block, first = self.prefilling, len(self.running)
            self.rows.hold(request.row, request.sig[:request.position], request.table, request.session)
        else:
            return
        if error:
            self.rows.forget(request.row)
        self.rows.release(request.row)
        self._exchange(block, block.index(request), len(block) - 1, first)
        block.pop()
        if block is self.running and self.prefilling:  # the row left free must follow the running ones
            moved = self.prefilling.pop()
            self.rows.swap(len(self.running), moved.row)
            moved.row = len(self.running)
            self.prefilling.insert(0, moved)
        request.row = -1

    def _exchange(self, block: list[Request], i: int, j: int, first: int) -> None:
        """Swap entries i and j of `block` (whose entry k runs in row first + k) and their rows."""
        if i == j:
            return
        self.rows.swap(first + i, first + j)
        block[i], block[j] = block[j], block[i]
        block[i].row, block[j].row = first + i, first + j

    def drop_all(self) -> list[Request]:
        """Every request still waiting, reading its prompt or running (the engine closes)."""
        with self._wake:
            left, self.waiting = self.running + self.prefilling + self.waiting, []
        return left

    def status(self) -> dict[str, int]:
        """Requests holding a row (`running`, those reading their prompts included) and waiting for one."""
        return {"running": len(self.running) + len(self.prefilling), "prefilling": len(self.prefilling),
                "queued": len(self.waiting), "max_batch": self.max_batch, "cache_rows": len(self.rows),
                "most_running": self.most_held}
