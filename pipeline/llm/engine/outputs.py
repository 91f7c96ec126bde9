"""Handing a step's tokens to its requests (`Outputs.settle`, one routine for every step kind): each token read
from the host (a step behind the GPU), the grammars advanced, proposed tokens kept or rolled back, the stop,
length and context checks, the stream's statistics, and a request's end.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import Tensor

from pipeline.llm.engine.cache_rows import CacheRows
from pipeline.llm.engine.sampler import logprobs_of
from pipeline.llm.engine.plan import Request, StepPlan
from pipeline.llm.engine.scheduler import Scheduler
from pipeline.llm.engine.seam import FinishReason


@dataclasses.dataclass
class Launched:
    """A launched step: its plan, the tokens it drew [n, T] and how many of each row's it keeps [n] (on the
    device and, once `copied` is done, on the host: one copy, [n, T + 1]), their log-probabilities where asked
    for, and the logits where a request keeps them. `consumed`: its tokens have advanced the grammars."""

    plan: StepPlan
    chained: tuple[Tensor, Tensor]  # the rows' last kept tokens and kept counts, on the device: a next step's inputs
    logits: Tensor | None
    logprobs: Tensor | None
    copied: tuple[Tensor, "torch.cuda.Event | None"]
    consumed: bool = False

    @property
    def requests(self) -> list[Request]:
        return [s.request for s in self.plan.drawing]


class Outputs:
    """`to_host` starts a tensor's copy to the host (`ModelRunner.to_host`)."""

    def __init__(self, scheduler: Scheduler, rows: CacheRows, context: int,
                 to_host: Callable[[Tensor], tuple[Tensor, "torch.cuda.Event | None"]]):
        self.scheduler, self.rows, self.context, self.to_host = scheduler, rows, context, to_host

    def launched(self, plan: StepPlan, drawn: Tensor, kept: Tensor, logits: Tensor | None,
                 logprobs: Tensor | None) -> Launched:
        """A step whose tokens `drawn` and counts `kept` (and log-probabilities) start their way to the host."""
        if logprobs is not None:
            logprobs = logprobs.to("cpu", non_blocking=True)  # pinned: ready with the tokens' copy
        n = len(plan.rows)
        last = drawn[:n].gather(1, kept[:n, None] - 1)[:, 0] if plan.verifies else drawn[:n, 0]
        return Launched(plan, (last, kept[:n]), logits, logprobs, self.to_host(torch.cat([drawn, kept[:, None]], 1)))

    def _host(self, step: Launched) -> tuple[list[list[int]], list[int]]:
        """The step's drawn tokens and kept counts on the host (waiting for its copy)."""
        host, done = step.copied
        if done is not None:
            done.synchronize()
        values = host.tolist()
        return [v[:-1] for v in values], [v[-1] for v in values]

    def consume(self, step: Launched) -> None:
        """Advance the grammars of a step's requests by the tokens they keep (once per step)."""
        if step.consumed:
            return
        step.consumed = True
        for s, tokens, kept in zip(step.plan.drawing, *self._host(step)):
            r = s.request
            if r.grammar is not None and r.row >= 0 and not r.stream.cancelled:
                for token in tokens[:kept]:
                    r.grammar.consume(token)

    def settle(self, step: Launched) -> None:
        """Hand out a finished step's tokens: the one settlement of every step kind. A prompt read to its end
        joins the running requests with its first token; a running request keeps its fed tokens in its row
        and delivers each kept token, its proposed tokens kept up to the first the model would not have drawn
        (its cache is rolled back by position: the rejected positions are written again later, by the step
        launched after this one too, which moved its positions on the device; the scheduler, which proposed them,
        hears how many were kept)."""
        self.consume(step)
        tokens, kept = self._host(step)
        logits = step.logits if step.logits is not None else [None] * len(kept)
        logprobs = step.logprobs if step.logprobs is not None else [None] * len(kept)
        for s, drawn, k, row_logits, row_logprobs in zip(step.plan.drawing, tokens, kept, logits, logprobs):
            r = s.request
            if s.proposed:
                r.draws.skip(k - 1)  # the first position's number was taken at the launch
                self.scheduler.kept(r, len(s.proposed), k - 1)
                r.position -= s.size - k  # launched assuming all kept (a later step's too)
            fed = [r.last_token, *s.proposed]  # a chained row's last token: the one the step before delivered
            for j in range(k):
                if r.row < 0:  # finished while this step ran, or by an earlier token of it
                    break
                if r.stream.cancelled:
                    self.finish(r, r.stream.reason)
                    break
                if s.last:
                    self.scheduler.promote(r)
                else:
                    self.rows.append(r.row, fed[j])
                self.deliver(r, drawn[j], row_logits[j] if row_logits is not None else None,
                             row_logprobs[j] if row_logprobs is not None else None)

    def deliver(self, r: Request, token: int, logits: Tensor | None, logprobs: Tensor | None = None) -> None:
        """Hand `token` to its request, or end the request (a stop id, its length, the context end)."""
        stats = r.stream.stats
        now = time.perf_counter()
        if r.stream.logits is not None:
            r.stream.logits.append(logits.float().cpu())
        if r.stream.logprobs is not None and token not in r.stop_ids:
            r.stream.logprobs.append(logprobs_of(logprobs, r.params.logprobs))
        if not r.first_token_at:
            r.first_token_at = now
            stats.time_to_first_token_s = now - r.submitted
        stats.decode_s = now - r.first_token_at
        if token in r.stop_ids:
            self.finish(r, FinishReason.STOP)
            return
        stats.new_tokens += 1
        r.last_token = token
        r.stream.deliver(token)
        if stats.new_tokens >= r.params.max_new_tokens:
            self.finish(r, FinishReason.LENGTH)
        elif len(self.rows[r.row].held) + 1 >= self.context:
            self.finish(r, FinishReason.CONTEXT)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request: its row, holding its tokens for whoever continues them, leaves the block of rows
        in use; then its stream closes."""
        self.scheduler.leave(request, error=reason == FinishReason.ERROR)
        request.stream.end(reason)

