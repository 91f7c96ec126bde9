"""Scheduler: which requests wait, which read their prompts, which run, and in which cache rows.

Continuous batching as in vLLM and TensorRT-LLM's executor: up to `max_batch` requests hold a row; new
ones join between decode steps, and finished or cancelled ones leave at once. A joining request
first reads its prompt, in chunks (vLLM's chunked prefill): while requests run, each engine step has a
budget of `step_tokens` positions, one for each running request's decode and the rest for prompt chunks
of the requests reading theirs, shared fairly (`chunks`), so a long prompt stalls neither the running
chats nor a short prompt that joins after it. Where the engine speculates, the scheduler owns the drafts: it
asks the `Proposer` for each running request's (by its acceptance so far, under what pays for the batch),
puts them in the step's plan, and hears how many were kept. Rows are kept in one order: running requests
in rows 0..R-1 (so a decode step reads the cache as a plain view), then the requests reading their prompts; a joining
request's row is moved to the first free place, a request whose prompt is read moves to row R, and
a leaving one's row is swapped out of the block. The engine thread alone changes the rows; any
thread may add a request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from pipeline.errors import UserError
from pipeline.llm.engine.cache_rows import CacheRows
from pipeline.llm.engine.plan import Request, Scheduled, StepPlan
from pipeline.llm.engine.speculation import DRAFT_SIZES, Ask, DraftState, Speculation, VerifyCost, batch_cap


class Scheduler:
    """`step_tokens`: each step's budget while requests run; `lone_tokens`: while none runs. None: no
    budget, a prompt is read whole in one step. `proposer`: where the running requests' drafts come from
    (speculative decoding; None: no drafts). `padded_rows`: where a step that reads prompt tokens beside
    running requests computes that many rows whatever runs (a GPU's graphs), the budget counts them, not the
    running requests alone."""

    def __init__(self, max_batch: int, rows: CacheRows, step_tokens: int | None = None,
                 lone_tokens: int | None = None, proposer: Proposer | None = None, padded_rows: int | None = None):
        self.max_batch, self.rows, self.proposer, self.padded_rows = max_batch, rows, proposer, padded_rows
        self.step_tokens, self.lone_tokens = step_tokens or None, lone_tokens or None
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # running[i] runs in cache row i
        self.prefilling: list[Request] = []  # prefilling[j] reads its prompt in row len(running) + j
        self._wake = threading.Condition()
        self._closed = ""  # why no request is taken any more, once closed
        self.most_held = 0  # the most requests that have held rows at once (a batch seen, whatever the polling)
        self.drafted = self.accepted = 0  # drafted tokens checked and kept, over every step settled

    def add(self, request: Request) -> None:
        """Queue a request (any thread); where drafts are proposed, it gets its drafting state."""
        if self.proposer is not None:
            self.proposer.join(request)
        with self._wake:
            if self._closed:
                raise UserError(self._closed)
            self.waiting.append(request)
            self._wake.notify()

    def close(self, why: str = "the language model was unloaded; reload the page") -> None:
        """No more requests (`add` raises `why`); the engine thread's `next_joining` returns None."""
        with self._wake:
            self._closed = why
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

    def plan(self, in_flight: StepPlan | None, settle: Callable[[], None]) -> StepPlan:
        """This step: each running request's last token and its draft, padded to a draft size, and the prompt chunks
        the budget leaves room for. `in_flight`: the step the running rows chain on, not settled yet (its last
        kept tokens and their positions are on the device). Drafts continue the text: where one may come, by the
        text the host knows (`Proposer.may_find`), that step is settled first (`settle`); else this step runs
        plain, chained on it. No draft is proposed while a prompt is read (its chunk rides along)."""
        drafts = None
        if self.proposer is not None and self.running and not any(r.position < len(r.sig) for r in self.prefilling):
            wanted = self.proposer.wanted(self.running)
            if any(wanted.values()) and (in_flight is None or self.proposer.may_find(wanted, self.rows)):
                if in_flight is not None:
                    settle()
                    in_flight = None
                drafts = self.proposer.drafts(self.running, wanted, self.rows)
        drafts = drafts or [()] * len(self.running)
        width = next(k for k in (0, *DRAFT_SIZES) if k >= max(map(len, drafts), default=0))  # graphs hold these
        rows = tuple(Scheduled(r, r.position, 1 + len(d), d, in_flight is not None, width=1 + width)
                     for r, d in zip(self.running, drafts))
        chunks = tuple(Scheduled(r, r.position, end - r.position, last=end == len(r.sig))
                       for r, end in self.chunks(sum(map(len, drafts))))
        return StepPlan(rows, chunks)

    def chunks(self, drafted: int = 0) -> list[tuple[Request, int]]:
        """This step's prompt chunks, as (request, the position its chunk ends at), in row order. The budget:
        while requests run, `step_tokens` less one position per running request (or `padded_rows`) and the
        `drafted` tokens they check (at least one, so that prompts always advance); with none running,
        `lone_tokens`, unless `step_tokens` already ends one of several prompts' reads: then that step is as
        short as a running one's, and that prompt's first token does not wait for a long chunk of the others.
        It is shared fairly among the prompts being read: each gets an equal part, and what a short one leaves
        goes to the others (water-filling). So a short prompt that joins while a long one is read gets its
        first token after a step or two, not after the long one's whole prefill. No budget (None): prompts are
        read whole (for comparison)."""
        reading = [r for r in self.prefilling if r.position < len(r.sig)]  # not those whose first token is drawn
        if self.running and self.step_tokens:
            return self._shared(reading, self.step_tokens - (self.padded_rows or len(self.running)) - drafted)
        if self.running or not self.lone_tokens:
            return [(r, len(r.sig)) for r in reading]
        short = self._shared(reading, self.step_tokens) if self.step_tokens and len(reading) > 1 else []
        if any(end == len(r.sig) for r, end in short):
            return short
        return self._shared(reading, self.lone_tokens)

    def _shared(self, reading: list[Request], budget: int) -> list[tuple[Request, int]]:
        """`budget` positions (at least one) shared fairly among the prompts `reading`, in row order."""
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

    def kept(self, request: Request, drafted: int, accepted: int) -> None:
        """A step checked `request`'s `drafted` tokens and kept the first `accepted`: its drafting hears it (while
        it runs: one that ended meanwhile has no drafting left)."""
        if (state := self.proposer.states.get(request)) is not None:
            state.record(drafted, accepted)
        request.stream.stats.drafted_tokens += drafted
        request.stream.stats.accepted_tokens += accepted
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted

    def promote(self, request: Request) -> None:
        """`request` has read its prompt: it joins the running requests, in row len(running)."""
        j, first = self.prefilling.index(request), len(self.running)
        self._exchange(self.prefilling, 0, j, first)
        self.running.append(self.prefilling.pop(0))

    def leave(self, request: Request, error: bool) -> None:
        """`request` stops: its row keeps its tokens (what it read of its prompt, for one still reading it;
        forgotten after an `error`: unknown) and leaves the block of rows in use."""
        if self.proposer is not None:
            self.proposer.leave(request)
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
                "most_running": self.most_held, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted}


class Proposer:
    """Which running requests draft in a step and how many tokens each (`speculation.py` has the policy and
    the drafters), and their drafts, asked of the drafter once for all of them, so a draft model's engine
    drafts them as one batch instead of one blocking call per row. `costs`: what a verify step of so many
    rows costs, fixed while the engine runs (the prior, or measured once per GPU: `speculation.costs_on`), so
    which steps verify follows from the tokens alone. Per row count: low-bit weights' batch kernels make a
    step of 8 rows × 9 tokens cost several of 8 rows' decode steps, where one row's 9 tokens cost little more
    than its one."""

    def __init__(self, speculation: Speculation, context: int):
        self.speculation, self.context = speculation, context
        self.costs: dict[int, VerifyCost] = {1: speculation.cost}
        self.states: dict[Request, DraftState] = {}  # each request's drafting, from `add` until it leaves

    @property
    def widths(self) -> tuple[int, ...]:
        """How many tokens a running request may feed in a step: its last token, and a draft of a draft size."""
        return 1, *(k + 1 for k in DRAFT_SIZES)

    def join(self, request: Request) -> None:
        """A new request's drafting state (its drafter's own, and its acceptance so far)."""
        self.states[request] = DraftState(self.speculation.drafter.index())

    def leave(self, request: Request) -> None:
        """`request` ended: its drafting state goes, and its drafter forgets it."""
        if (state := self.states.pop(request, None)) is not None:
            self.speculation.drafter.forget(state.drafts)

    def cost_for(self, rows: int) -> VerifyCost:
        """The cost measured for the fewest rows at least `rows` (the most measured, past them)."""
        return self.costs[min((n for n in self.costs if n >= rows), default=max(self.costs))]

    def wanted(self, running: Sequence[Request]) -> dict[Request, int]:
        """How many tokens each running request would draft this step (0: none), by its acceptance so far, cut
        for a batch of several to what pays for all of its rows (`speculation.batch_cap`); none past `max_rows` rows."""
        if len(running) > self.speculation.max_rows:
            return {}
        most, cost = self.speculation.max_draft, self.cost_for(len(running))
        asked = {r: self.states[r].wanted(cost, most, self.room(r)) for r in running}
        if len(running) < 2 or not any(asked.values()):
            return asked
        cap = batch_cap([(self.states[r].expected_rate, k) for r, k in asked.items()], cost)
        return {r: min(k, cap) for r, k in asked.items()}

    def may_find(self, wanted: dict[Request, int], rows: CacheRows) -> bool:
        """Whether a draft may come, looked at with the tokens already known (without the step in flight's,
        whose reading stalls the GPU): a drafter that always has one says yes without looking."""
        drafter = self.speculation.drafter
        return drafter.always or any(drafter.propose([Ask(self.states[r].drafts, rows[r.row].held, (r.last_token,), 1)
                                                      for r, k in wanted.items() if k]))

    def drafts(self, running: Sequence[Request], wanted: dict[Request, int],
               rows: CacheRows) -> list[tuple[int, ...]] | None:
        """Each running request's draft (in row order), asked of the drafter in one call; None where none was
        found: the step is a plain one. None as well past `max_rows` rows (settling the step in flight may have
        promoted a prompt since `wanted`)."""
        if len(running) > self.speculation.max_rows:
            return None
        asking = [r for r in running if wanted.get(r) and self.room(r) > 0]
        if not asking:
            return None
        asks = [Ask(self.states[r].drafts, rows[r.row].held, (r.last_token,), min(wanted[r], self.room(r)))
                for r in asking]
        found = {r: tuple(self.cut(r, draft)) for r, draft in zip(asking, self.speculation.drafter.propose(asks))}
        drafts = [found.get(r, ()) for r in running]
        return drafts if any(drafts) else None

    def room(self, r: Request) -> int:
        """Tokens `r` may draft: what its reply's length and the context leave after this step's own token."""
        return min(r.params.max_new_tokens - r.stream.stats.new_tokens, self.context - r.position) - 1

    @staticmethod
    def cut(r: Request, draft: list[int]) -> list[int]:
        """`draft` cut after a stop id, and where `r` has a grammar, to what it allows before any stop id (its
        masks are made through the draft)."""
        ends = [i for i, t in enumerate(draft) if t in r.stop_ids]
        if r.grammar is not None:
            draft = draft[:ends[0] if ends else len(draft)]
            return draft[:r.grammar.allowed_prefix(draft)]
        return draft[:ends[0] + 1] if ends else draft
