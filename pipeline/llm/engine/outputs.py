"""Handing a step's tokens to its requests: each token read from the host (a step behind the GPU), the
grammars advanced, the stop, length and context checks, the stream's statistics, and a request's end.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import Tensor

from pipeline.llm.engine.cache_rows import CacheRows
from pipeline.llm.engine.sampler import logprobs_of
from pipeline.llm.engine.scheduler import Request, Scheduler
from pipeline.llm.engine.seam import FinishReason


@dataclasses.dataclass
class Launched:
    """A launched decode step, or the first draw of a request whose prompt is read: who ran in it, the
    drawn tokens (on the device and, once `copied` is done, on the host, with their log-probabilities
    where asked for), and the logits where a request keeps them. `consumed`: its tokens have advanced
    the requests' grammars."""

    requests: list[Request]
    drawn: Tensor
    logits: Tensor | None
    logprobs: Tensor | None
    copied: tuple[Tensor, "torch.cuda.Event | None"]
    consumed: bool = False


class Outputs:
    """`to_host` starts a tensor's copy to the host (`ModelRunner.to_host`)."""

    def __init__(self, scheduler: Scheduler, rows: CacheRows, context: int,
                 to_host: Callable[[Tensor], tuple[Tensor, "torch.cuda.Event | None"]]):
        self.scheduler, self.rows, self.context, self.to_host = scheduler, rows, context, to_host

    def launched(self, requests: list[Request], drawn: Tensor, kept: Tensor | None,
                  logprobs: Tensor | None) -> Launched:
        """A step whose tokens `drawn` (and log-probabilities) start their way to the host."""
        if logprobs is not None:
            logprobs = logprobs.to("cpu", non_blocking=True)  # pinned: ready with the tokens' copy
        return Launched(requests, drawn, kept, logprobs, self.to_host(drawn))

    def consume(self, step: Launched) -> None:
        """Advance the grammars of a step's requests by the tokens it drew (once per step)."""
        if step.consumed:
            return
        step.consumed = True
        host, done = step.copied
        if done is not None:
            done.synchronize()
        for r, token in zip(step.requests, host.tolist()):
            if r.grammar is not None and r.row >= 0 and not r.stream.cancelled:
                r.grammar.consume(token)

    def read(self, step: Launched, starting: bool = False) -> None:
        """Hand out a finished step's tokens to the requests still running (`starting`: their first
        tokens, with which they join the running ones)."""
        self.consume(step)
        host, _ = step.copied
        rows = step.logits if step.logits is not None else [None] * len(step.requests)
        logprobs = step.logprobs if step.logprobs is not None else [None] * len(step.requests)
        for r, token, row_logits, row_logprobs in zip(step.requests, host.tolist(), rows, logprobs):
            if r.row < 0:  # finished while this step ran
                continue
            if r.stream.cancelled:
                self.finish(r, r.stream.reason)
                continue
            if starting:
                self.scheduler.promote(r)
            else:
                self.rows.append(r.row, r.last_token)
            self.deliver(r, token, row_logits, row_logprobs)

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

