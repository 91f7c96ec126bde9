"""Sampling parameters (validated once, with messages a user can act on) and the next-token draw."""

from __future__ import annotations

import dataclasses

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


def next_token(logits: Tensor, params: SamplingParams, seen: Tensor, generator: torch.Generator | None) -> Tensor:
    """Draw one token id from `logits` [vocab]; `seen` [vocab] bool marks ids for the repetition penalty.

    Order as in transformers: repetition penalty, temperature, top-k, top-p. Returns a 0-d tensor
    on the logits' device, so the caller decides when to synchronise.
    """
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        penalised = torch.where(logits < 0, logits * params.repetition_penalty, logits / params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if params.temperature == 0:
        return logits.argmax()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keeps the token that crosses top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]
