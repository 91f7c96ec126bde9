"""Speculative decoding's policy: where drafts come from, how many to check, and what a check costs.

A decode step at batch 1 reads every weight for one token; a verify step (the same step, its row feeding
1 + k tokens) reads them once for the row's last token and k drafted after it, at little more cost (1.07-1.14x a decode step for k = 1..8 in
bf16 at Qwen2.5-7B's shapes on an H100, `bench/speculative.py`). Each drafted token the model would
have produced itself is a token gained. The drafts here come from *prompt lookup* (llama.cpp's
`lookup`, vLLM's n-gram proposer): the longest recent n-gram of the conversation that ends the text so
far is found earlier in it, and the tokens that followed it there are proposed. It needs no second
model and pays where replies quote their input: edits of code, summaries, documents, long histories.

How many to draft is decided per request from its recent acceptance rate (a geometric model: each
drafted token accepted with probability a, independently): k maximises the expected tokens per step,
(1 - a^(k+1)) / (1 - a), over the step's cost, `VerifyCost`; where no k pays, the request stops
drafting and tries again with a short draft every `PROBE_EVERY` steps, so a chat where lookup does not
pay runs as plain decode steps. With several chats the step's cost is the batch's: `batch_cap` cuts every
row's draft to the length that pays for the batch as a whole, none where none does, so by the cost model a
batch never runs slower for its drafts; past `Speculation.max_rows` chats none drafts (there the model erred). The cost
is fixed while the engine runs (on a GPU measured once by the first launch, `costs_on`, and kept for the next
ones), never read from the clock between steps: which steps verify follows
from the tokens alone, the same in every run. The engine's scheduler owns the drafts (`scheduler.Proposer`:
which rows draft in a step, and how many tokens). A drafter is asked once per step for every row that drafts
(`Drafter.propose`): a draft model's engine then drafts for all of them as one batch. A draft continues the text,
so the step in flight is read first where a draft may come (`Scheduler.plan`); every other step runs one ahead
of the host, after a verify step too. Two ways not to wait there measured slower (7B on an H200, 2026-11-30,
`bench/RESULTS.md`): guessing the token the step in flight draws, and drafting on the device (vLLM's `ngram_gpu`)
in a step as wide as the host decided without that step's tokens. Which token is kept is the sampler's business
(`Sampler.draw`): the acceptance rule keeps the output's distribution, and a seeded reply's
tokens, exactly those of plain decoding.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from pipeline.files import atomic_write
from plugins.precompile import VERIFY_ROWS

# a step checks one of these many positions past the last token (one CUDA graph each; the kernels compile for these)
DRAFT_SIZES = tuple(rows - 1 for rows in VERIFY_ROWS)
MAX_DRAFT = DRAFT_SIZES[-1]  # drafted tokens per step at most (a verify step scores MAX_DRAFT + 1 positions)
# a step verifies drafts only while at most this many chats run (a power of two: a graph bucket). Prompt lookup
# against plain steps (H200, 2026-11-30, bench/RESULTS.md), by the cost model never slower: with drafts up to 4
# rows, 4 chats 0.95x (bf16) and 0.99x (int4), 8 chats 0.99x and 0.94x; up to 2 rows, 2 chats 1.01-1.11x and
# 0.97-1.00x, 4 chats 1.02-1.14x and 1.01-1.04x, 8 chats 0.99-1.01x and 1.00-1.03x. Each larger bucket's verify
# graphs also cost every launch their captures. Low-bit weights on a GPU draft with one chat only (2 chats
# 0.97-1.00x in four runs, H200 2026-11-30: `LOW_BIT_MAX_ROWS`).
MAX_ROWS = 2
LOW_BIT_MAX_ROWS = 1
PROBE_EVERY = 16  # plain steps before a request whose drafts stopped paying tries a short draft again
DECAY = 0.8  # weight of the earlier acceptance counts at each new verify


@dataclasses.dataclass(frozen=True)
class VerifyCost:
    """A verify step with k ≥ 1 drafted tokens per row costs `1 + fixed + per_token * k` decode steps.
    Measured: H100, Qwen2.5-7B shapes, bf16 0.06 + 0.007 k, int4 0.07 + 0.34 k (its rows run as one-row
    calls, `plugins.lowbit.rows_as_one_row`: each costs about a third of a decode step; `bench/speculative.py`);
    SmolLM2-135M on 2 CPU cores in fp32 0.0 + 0.085 k."""

    fixed: float
    per_token: float

    def __call__(self, k: int) -> float:
        return 1.0 + (self.fixed + self.per_token * k if k else 0.0)


def read_costs(path: Path) -> dict[int, VerifyCost] | None:
    """The verify costs recorded in `path` per row count (`write_costs`); None where there is no record, or one
    this cannot read (then they are measured again)."""
    try:
        return {int(rows): VerifyCost(float(fixed), float(per_token))
                for rows, (fixed, per_token) in json.loads(Path(path).read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def write_costs(path: Path, costs: dict[int, VerifyCost]) -> None:
    """Keep costs measured on this GPU for the next launch, as the kernels' tuned configs are kept."""
    atomic_write(path, json.dumps({rows: [c.fixed, c.per_token] for rows, c in costs.items()}))


def fit_cost(seconds: Callable[[int, bool], float]) -> VerifyCost:
    """What a step checking k drafted tokens a row costs in plain steps of the same rows, from `seconds(k,
    settled)`: such steps timed on the GPU (`ModelRunner.step_seconds`), host work included (a small model on
    a fast GPU is bound by it, not by its weights). The fixed part also holds the wait a verify step costs
    the host where its tokens are settled before the next step is launched (`Scheduler.plan`), where
    plain steps run one ahead of the host (speculation measured slower than none with 8 chats and on int4's
    open chat while this wait was left out, H200 2026-11-28; and slower with it left out for verify steps
    run one ahead, 2026-11-30)."""
    plain = seconds(0, False)
    wait = max(seconds(0, True) / plain - 1.0, 0.0)
    extra = [(k, seconds(k, False) / plain - 1.0) for k in DRAFT_SIZES]
    mean_k, mean_e = sum(k for k, _ in extra) / len(extra), sum(e for _, e in extra) / len(extra)
    slope = sum((k - mean_k) * (e - mean_e) for k, e in extra) / sum((k - mean_k) ** 2 for k, _ in extra)
    slope = max(slope, 0.0)
    return VerifyCost(max(mean_e - slope * mean_k, 0.0) + wait, slope)


def costs_on(spec: Speculation, seconds: Callable[[int, int, bool], float],
             row_counts: Sequence[int]) -> dict[int, VerifyCost] | None:
    """The verify costs of `spec` on this GPU per row count: those an earlier launch recorded, else fitted now
    from `seconds(rows, k, settled)` (`fit_cost`) and recorded, measured once per GPU as the kernels' tuning
    is; None where the prior costs serve (a CPU's were measured once: its tests decide nothing by the clock)."""
    if not spec.measured:
        return None
    if spec.record is not None and (costs := read_costs(spec.record)) is not None:
        return costs
    costs = {rows: fit_cost(lambda k, settled: seconds(rows, k, settled)) for rows in sorted(set(row_counts))}
    if spec.record is not None:
        write_costs(spec.record, costs)
    return costs


GPU_FLOAT = VerifyCost(0.06, 0.007)
GPU_LOW_BIT = VerifyCost(0.07, 0.34)
CPU = VerifyCost(0.0, 0.085)


def expected_tokens(accept: float, k: int) -> float:
    """Tokens a step gives with k drafted tokens, each accepted with probability `accept` (independently):
    the accepted run plus the one token the check always yields."""
    return float(k + 1) if accept >= 1.0 else (1.0 - accept ** (k + 1)) / (1.0 - accept)


def best_draft(accept: float, cost: Callable[[int], float], limit: int = MAX_DRAFT) -> int:
    """The draft length (0 or one of DRAFT_SIZES up to `limit`) with the most tokens per unit of step cost;
    0 where no draft gains 2 % over a plain step."""
    best, gain = 0, 1.02
    for k in DRAFT_SIZES:
        if k <= limit and expected_tokens(accept, k) / cost(k) > gain:
            best, gain = k, expected_tokens(accept, k) / cost(k)
    return best


def batch_cap(rows: Sequence[tuple[float, int]], cost: Callable[[int], float]) -> int:
    """The longest draft a step of several rows checks (0: none), given each row's acceptance rate and the draft
    it wants: a verify step's cost is the whole batch's, every row waiting for the longest draft, so a draft
    pays only if the batch's expected tokens beat a plain step's, one a row at a cost of 1. Each cap (0 and
    DRAFT_SIZES) cuts every row's draft to it; the one with the most expected tokens per unit of cost wins,
    and a cap must gain 2 % over plain steps, as `best_draft` asks of one row."""
    best, gain = 0, 1.02 * len(rows)
    for cap in DRAFT_SIZES:
        longest = max((min(k, cap) for _, k in rows), default=0)
        tokens = sum(expected_tokens(rate, min(k, cap)) for rate, k in rows)
        if longest and tokens / cost(longest) > gain:
            best, gain = cap, tokens / cost(longest)
    return best


class PerRequest:
    """A drafter whose requests draft one by one, each from its own state (`index()`), which drafts with
    `draft(history, k, last)`: prompt lookup (each request's own n-gram index), and plain test drafters."""

    def propose(self, asks: Sequence[Ask]) -> list[list[int]]:
        return [a.state.draft(a.history, a.k, a.last) for a in asks]

    def forget(self, state) -> None:
        """A request ended: its state goes with it (nothing else holds it)."""


class PromptLookup(PerRequest):
    """Drafts from the conversation itself: the tokens that followed the most recent earlier occurrence of
    the longest n-gram (`max_ngram` down to `min_ngram` tokens) that ends the text so far. A request
    keeps its own index of where each n-gram last ended (`NgramIndex`), brought up to date with each
    step's new tokens, so a draft costs a few dictionary lookups however long the conversation."""

    always = False  # it may find nothing: whether it would is looked at before the step in flight is read
    name = "prompt lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def index(self) -> NgramIndex:
        return NgramIndex(self.max_ngram, self.min_ngram)

    def close(self) -> None:
        """Nothing to let go of (a draft model's drafter closes its engine)."""


class NgramIndex:
    """Where each n-gram of one request's history last ended. The history only grows while the request
    runs (rejected drafts never enter it); entries that are not token ids (an image's slots) never match."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self._ends: dict[tuple, int] = {}
        self._done = 0  # n-grams ending before this position are indexed

    def draft(self, history: Sequence, k: int, last: Sequence = ()) -> list[int]:
        """Up to `k` tokens that followed the longest n-gram ending `history` + `last` (a row's held tokens and
        its token not yet fed, not copied into one list at every step) where it last occurred before."""
        history = _Joined(history, last) if last else history
        total = len(history)
        for end in range(max(self._done, 1), total):  # the n-grams ending before the text's last position
            for n in self.sizes:
                if end >= n:
                    self._ends[tuple(history[end - n:end])] = end
        self._done = max(self._done, total)
        for n in self.sizes:
            if total >= n and (end := self._ends.get(tuple(history[total - n:]))) is not None:
                out = []
                for token in history[end:end + k]:
                    if not isinstance(token, int):
                        break
                    out.append(token)
                return out
        return []


class _Joined(Sequence):
    """`head` followed by a short `tail`, read as one sequence (slices near the end copy little)."""

    def __init__(self, head: Sequence, tail: Sequence):
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __getitem__(self, index):
        n = len(self.head)
        if isinstance(index, slice):
            start, stop, _ = index.indices(len(self))
            return list(self.head[start:min(stop, n)]) + list(self.tail[max(start - n, 0):max(stop - n, 0)])
        index = index + len(self) if index < 0 else index
        return self.head[index] if index < n else self.tail[index - n]


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request's draft wanted in a step: its own drafting state (`Drafter.index()`), its text so far
    (`history` + `last`: a row's held tokens and its token not yet fed) and at most `k` tokens to follow it."""

    state: Any
    history: Sequence
    last: Sequence
    k: int


class Drafter(Protocol):
    """Where drafts come from: `index()` makes a request's own state; `propose(asks)` drafts for every asking
    request of a step at once (up to each one's k tokens after its text); `forget(state)`: a request ended.
    `always`: it always has a draft (else the engine looks with the tokens it already knows before it waits
    for the step in flight)."""

    always: bool
    name: str

    def index(self) -> Any: ...

    def propose(self, asks: Sequence[Ask]) -> list[list[int]]: ...

    def forget(self, state: Any) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Speculation:
    """An engine's speculative decoding: its drafter and what a verify step costs on its device."""

    drafter: Drafter
    cost: VerifyCost
    max_draft: int = MAX_DRAFT
    measured: bool = False  # the engine measures the cost on its GPU (`costs_on`), once: kept in
    record: Path | None = None  # this file, and read from it by later launches
    exact: bool = True  # False: one chat's low-bit verify steps take the batch kernels (`ModelRunner.exact_rows`)
    max_rows: int = MAX_ROWS  # drafts only while at most this many chats run

    @property
    def description(self) -> str:
        return f"speculative decoding by {self.drafter.name} (up to {self.max_draft} tokens)"


def prompt_lookup(device: str, low_bit: bool, exact: bool = True, record: Path | None = None) -> Speculation:
    """Prompt lookup with the verify cost measured for `device`'s kind ("cuda" or "cpu") and weights; on a
    GPU the engine measures its own steps once and keeps them in `record` (a CPU's costs were measured once:
    its tests decide nothing by the clock). `exact`: see `Speculation.exact`."""
    if device == "cpu":
        return Speculation(PromptLookup(), CPU, exact=exact)
    return Speculation(PromptLookup(), GPU_LOW_BIT if low_bit else GPU_FLOAT, measured=True, exact=exact,
                       record=record, max_rows=LOW_BIT_MAX_ROWS if low_bit else MAX_ROWS)


@dataclasses.dataclass
class DraftState:
    """One request's drafting: its drafter, its recent acceptance (decayed counts of accepted and
    checked drafted tokens) and how long its drafting has been paused."""

    drafts: Any  # the request's own drafting state (`Drafter.index()`)
    accepted: float = 2.0  # a prior of 2 accepted of 3 checked: new requests try drafting at once
    checked: float = 3.0
    paused: int = 0  # plain steps since its drafts stopped paying
    whole: bool = False  # its last draft was kept whole: quoting runs on, so the next one is as long as allowed

    @property
    def rate(self) -> float:
        return self.accepted / self.checked

    @property
    def expected_rate(self) -> float:
        """The rate its draft length is chosen by: all kept while its last draft was kept whole (`wanted`)."""
        return 1.0 if self.whole else self.rate

    def wanted(self, cost: Callable[[int], float], max_draft: int, room: int) -> int:
        """How many tokens to draft this step (at most `room`): by the acceptance rate and what a verify step
        `cost`s (acceptance comes in runs: a reply quoting its input keeps whole drafts, so after one the
        next is as long as pays if all is kept), or a short probe every PROBE_EVERY steps while drafting does
        not pay at this rate; none where it would not pay even if all were kept (a step of many low-bit rows)."""
        limit = min(room, max_draft)
        if self.whole or best_draft(1.0, cost, limit) == 0:  # as long as pays if all is kept; none: nothing pays
            return best_draft(1.0, cost, limit)
        k = best_draft(self.rate, cost, limit)
        if k:
            return k
        self.paused += 1
        if self.paused >= PROBE_EVERY and room >= 2:
            self.paused = 0
            return 2
        return 0

    def record(self, drafted: int, accepted: int) -> None:
        """A verify step checked `drafted` tokens and kept the first `accepted`; a rejection ends the run,
        so the tokens after it say nothing of the rate and are not counted."""
        if drafted:
            self.accepted = DECAY * self.accepted + accepted
            self.checked = DECAY * self.checked + accepted + (accepted < drafted)
            self.whole = accepted == drafted
