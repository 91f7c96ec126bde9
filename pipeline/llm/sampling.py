"""Sampling parameters (validated once, with messages a user can act on) and the next-token draw.

The draw works on a batch of rows, each with its own parameters, in one set of tensor operations,
and takes its randomness as one uniform number per row (inverse-CDF sampling) from the request's
own seeded generator: a row's token depends only on its logits, its parameters and its own random
stream, never on what else shares the batch.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import torch
from torch import Tensor

from pipeline.errors import UserError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off; seed None is random."""

    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    repetition_penalty: float = 1.05
    seed: int | None = None

    def validated(self) -> "SamplingParams":
        checks = [
            (isinstance(self.max_new_tokens, int) and 1 <= self.max_new_tokens <= 32768,
             f"max new tokens must be a whole number from 1 to 32768, got {self.max_new_tokens!r}"),
            (_number(self.temperature) and 0 <= self.temperature <= 5,
             f"temperature must be between 0 and 5, got {self.temperature!r}"),
            (_number(self.top_p) and 0 < self.top_p <= 1, f"top-p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and 0 <= self.top_k <= 100000,
             f"top-k must be a whole number ≥ 0 (0 = off), got {self.top_k!r}"),
            (_number(self.repetition_penalty) and 0.5 <= self.repetition_penalty <= 3,
             f"repetition penalty must be between 0.5 and 3, got {self.repetition_penalty!r}"),
            (self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
             f"seed must be empty or a whole number ≥ 0, got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        return self


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x rejects NaN


class Draws:
    """A request's own random stream: seeded for reproducible replies, else fresh entropy."""

    def __init__(self, seed: int | None):
        self._rng = random.Random(seed)

    def next(self) -> float:
        return self._rng.random()


COLUMNS = ("uniform", "temperature", "top_k", "top_p", "repetition_penalty")


def sampling_columns(params: Sequence[SamplingParams], uniforms: Sequence[float], vocab: int) -> list[list[float]]:
    """The per-row numbers `sample` reads, one list per entry of COLUMNS (top-k 0 = off)."""
    return [list(uniforms), [p.temperature for p in params],
            [p.top_k if 0 < p.top_k < vocab else 0 for p in params], [p.top_p for p in params],
            [p.repetition_penalty for p in params]]


def sample(logits: Tensor, params: Sequence[SamplingParams], seen: Tensor, columns: Tensor) -> Tensor:
    """Token ids [B] from `logits` [B, vocab]; row i uses `params[i]`, the repetition mask `seen[i]`
    (bool [vocab]) and column i of `columns` [5, B] (see `sampling_columns`, on the logits' device).

    Order as in transformers: repetition penalty, temperature, top-k, top-p. `params` only decides
    which steps the batch needs at all; the numbers come from `columns`, so a caller can upload
    them without waiting for the GPU. Returns a tensor on the logits' device.
    """
    uniform, temperature, top_k, top_p, penalty = columns
    if all(p.temperature == 0 and p.repetition_penalty == 1.0 for p in params):
        return logits.argmax(-1)
    logits = logits.float()
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = penalty[:, None]
        logits = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
    greedy = logits.argmax(-1)
    if all(p.temperature == 0 for p in params):
        return greedy
    logits = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    ks = [p.top_k if 0 < p.top_k < logits.shape[-1] else 0 for p in params]
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
