"""The engine's side of speculative decoding (`speculation.py` has the policy and the drafters): which
running requests draft in a step and how many tokens each, and their drafts, asked of the drafter once
for all of them, so a draft model's engine drafts them as one batch instead of one blocking call per row.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pipeline.llm.engine.cache_rows import CacheRows
from pipeline.llm.engine.model_runner import ModelRunner, RowsFeed
from pipeline.llm.engine.plan import Request
from pipeline.llm.engine.speculation import DRAFT_SIZES, Ask, DraftState, Speculation, VerifyCost, batch_cap
from pipeline.llm.model.kv_cache import KVCache


class Proposer:
    """`costs`: what a verify step of so many rows costs, fixed while the engine runs (the prior, or measured
    once as the engine starts on a GPU), so which steps verify follows from the tokens alone. Per row count:
    low-bit weights' batch kernels make a step of 8 rows × 9 tokens cost several of 8 rows' decode steps,
    where one row's 9 tokens cost little more than its one."""

    def __init__(self, speculation: Speculation, context: int):
        self.speculation, self.context = speculation, context
        self.costs: dict[int, VerifyCost] = {1: speculation.cost}

    @property
    def widths(self) -> tuple[int, ...]:
        """How many tokens a running request may feed in a step: its last token, and a draft of a draft size."""
        return 1, *(k + 1 for k in DRAFT_SIZES)

    def state(self) -> DraftState:
        """A new request's drafting state (its drafter's own, and its acceptance so far)."""
        return DraftState(self.speculation.drafter.index())

    def cost_for(self, rows: int) -> VerifyCost:
        """The cost measured for the fewest rows at least `rows` (the most measured, past them)."""
        return self.costs[min((n for n in self.costs if n >= rows), default=max(self.costs))]

    def wanted(self, running: Sequence[Request]) -> dict[Request, int]:
        """How many tokens each running request would draft this step (0: none), by its acceptance so far, cut
        for a batch of several to what pays for all of its rows (`speculation.batch_cap`)."""
        most, cost = self.speculation.max_draft, self.cost_for(len(running))
        asked = {r: r.draft.wanted(cost, most, self.room(r)) for r in running}
        if len(running) < 2 or not any(asked.values()):
            return asked
        cap = batch_cap([(r.draft.expected_rate, k) for r, k in asked.items()], cost)
        return {r: min(k, cap) for r, k in asked.items()}

    def may_find(self, wanted: dict[Request, int], rows: CacheRows) -> bool:
        """Whether a draft may come, looked at with the tokens already known (without the step in flight's,
        whose reading stalls the GPU): a drafter that always has one says yes without looking."""
        drafter = self.speculation.drafter
        return drafter.always or any(drafter.propose([Ask(r.draft.drafts, rows[r.row].held, (r.last_token,), 1)
                                                      for r, k in wanted.items() if k]))

    def drafts(self, running: Sequence[Request], wanted: dict[Request, int], rows: CacheRows) -> list[list[int]] | None:
        """Each running request's draft (in row order), asked of the drafter in one call; None where none was
        found: the step is a plain one."""
        asking = [r for r in running if wanted.get(r) and self.room(r) > 0]
        if not asking:
            return None
        proposed = self.speculation.drafter.propose(
            [Ask(r.draft.drafts, rows[r.row].held, (r.last_token,), min(wanted[r], self.room(r))) for r in asking])
        found = {r: self.cut(r, draft) for r, draft in zip(asking, proposed)}
        drafts = [found.get(r, []) for r in running]
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


def verify_cost(runner: ModelRunner, cache: KVCache, rows: int = 1, repeats: int = 20) -> VerifyCost:
    """What a step of `rows` rows checking k drafted tokens each costs in one-token steps of those rows
    for this model on this GPU, measured once (on the steps of the runner's graph table, where graphs are
    used): steps replayed in the scratch positions, which hold nothing; host work included (a small model on
    a fast GPU is bound by it, not by its weights). Fixed from then on, so which steps verify follows from the
    tokens alone, never from the clock between steps. Fitted as `VerifyCost`, whose fixed part also holds the
    wait a verify step costs the host: its tokens are settled before the next step is launched, where plain
    steps run one ahead of the host (speculation measured slower than none with 8 chats and on int4's open
    chat while this wait was left out, H200 2026-11-28)."""
    def seconds(k: int, settled: bool = False) -> float:
        feed = RowsFeed(rows, [[0] * (k + 1)] * rows, [runner.scratch] * rows, [0] * rows,
                        kv_need=runner.scratch + k + 1)
        for _ in range(3):  # a first run, and a replay
            runner.step(cache, feed)
        torch.cuda.synchronize(runner.device)
        start = time.perf_counter()
        for _ in range(repeats):
            logits, _ = runner.step(cache, feed)
            if settled:  # as a verify step is: its tokens read before the next launch
                logits[:, 0, :1].cpu()
        torch.cuda.synchronize(runner.device)
        return (time.perf_counter() - start) / repeats

    plain = seconds(0)
    wait = max(seconds(0, settled=True) / plain - 1.0, 0.0)
    extra = [(k, seconds(k) / plain - 1.0) for k in DRAFT_SIZES]
    mean_k, mean_e = sum(k for k, _ in extra) / len(extra), sum(e for _, e in extra) / len(extra)
    slope = sum((k - mean_k) * (e - mean_e) for k, e in extra) / sum((k - mean_k) ** 2 for k, _ in extra)
    slope = max(slope, 0.0)
    return VerifyCost(max(mean_e - slope * mean_k, 0.0) + wait, slope)
