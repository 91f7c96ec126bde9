"""The next-token draw (its parameters: `params.py`).

The draw works on a batch of rows, each with its own parameters, in one set of tensor operations,
and takes its randomness as one uniform number per row (inverse-CDF sampling) from the request's
own seeded generator: a row's token depends only on its logits, its parameters and its own random
stream, never on what else shares the batch.
"""

from __future__ import annotations

import collections
import itertools
import random
from collections.abc import Sequence

import torch
from torch import Tensor

from pipeline.llm.engine.params import SamplingParams
from plugins import topk_sampling


class Draws:
    """A request's own random stream: seeded for reproducible replies, else fresh entropy. One number per
    token kept: a verify step `peek`s one for each position it scores and `skip`s those of the tokens it
    keeps, so the numbers of rejected positions come again and a reply's draws never shift."""

    def __init__(self, seed: int | None):
        self._rng = random.Random(seed)
        self._ahead: collections.deque[float] = collections.deque()

    def next(self) -> float:
        return self._ahead.popleft() if self._ahead else self._rng.random()

    def peek(self, n: int) -> list[float]:
        while len(self._ahead) < n:
            self._ahead.append(self._rng.random())
        return list(itertools.islice(self._ahead, n))

    def skip(self, n: int) -> None:
        for _ in range(n):
            self.next()


COLUMNS = ("uniform", "temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty")


def sampling_columns(params: Sequence[SamplingParams], uniforms: Sequence[float], vocab: int) -> list[list[float]]:
    """The per-row numbers `sample` reads, one list per entry of COLUMNS (top-k 0 = off)."""
    return [list(uniforms), [p.temperature for p in params],
            [p.top_k if 0 < p.top_k < vocab else 0 for p in params], [p.top_p for p in params],
            [p.repetition_penalty for p in params], [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params]]


def counts_penalized(params: Sequence[SamplingParams]) -> bool:
    """Whether any row needs the counts of its reply's tokens (rows without these penalties pay nothing)."""
    return any(p.presence_penalty or p.frequency_penalty for p in params)


def sample(logits: Tensor, params: Sequence[SamplingParams], seen: Tensor, columns: Tensor,
           counts: Tensor | None = None) -> Tensor:
    """Token ids [B] from `logits` [B, vocab]; row i uses `params[i]`, the repetition mask `seen[i]`
    (bool [vocab]), how often its reply has used each token `counts[i]` (float [vocab], read only when
    a row has a presence or frequency penalty) and column i of `columns` [7, B] (see
    `sampling_columns`, on the logits' device).

    Order: OpenAI's presence and frequency penalties (as vLLM applies them, on the reply's tokens
    only), then as in transformers: repetition penalty, temperature, top-k, top-p. `params` only
    decides which steps the batch needs at all; the numbers come from `columns`, so a caller can upload
    them without waiting for the GPU. Returns a tensor on the logits' device.
    """
    uniform, temperature, top_k, top_p, penalty, presence, frequency = columns
    if counts_penalized(params):
        logits = logits.float() - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    if all(p.temperature == 0 and p.repetition_penalty == 1.0 for p in params):
        return logits.argmax(-1)
    ks = [p.top_k if 0 < p.top_k < logits.shape[-1] else 0 for p in params]
    if topk_sampling.applies(ks, [p.temperature for p in params], logits.device):
        return topk_sampling.sample_top_k(logits, seen, columns)  # two kernels instead of about twenty
    logits = logits.float()
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = penalty[:, None]
        logits = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
    greedy = logits.argmax(-1)
    if all(p.temperature == 0 for p in params):
        return greedy
    logits = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if all(ks):
        # Every row keeps at most max(k) tokens: sort only those (topk returns them in order), not
        # the whole vocabulary (152k entries for Qwen) as a row without top-k needs.
        ordered, order = torch.topk(logits, max(ks), dim=-1)
        ranks = torch.arange(ordered.shape[-1], device=logits.device)
        ordered = ordered.masked_fill(ranks[None] >= top_k[:, None], float("-inf"))
    else:
        if any(ks):
            kth = torch.topk(logits, max(ks), dim=-1).values.gather(1, (top_k.clamp(min=1) - 1).long()[:, None])
            logits = torch.where(top_k[:, None] > 0, logits.masked_fill(logits < kth, float("-inf")), logits)
        ordered, order = torch.sort(logits, dim=-1, descending=True)
    probs = ordered.softmax(-1)
    # top-p keeps the tokens before the one that crosses it, and that one
    ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= top_p[:, None], float("-inf"))
    cdf = ordered.softmax(-1).cumsum(-1)
    pick = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:]).clamp(max=cdf.shape[-1] - 1)
    return torch.where(temperature == 0, greedy, order.gather(1, pick)[:, 0])
