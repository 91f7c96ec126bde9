"""Perplexity and next-token agreement of a decoder over a fixed text: what a quantization costs in
answer quality, measured the way llama.cpp's `perplexity` tool does it (non-overlapping windows, each
scored from its second half on, so every scored token sees at least half a window of context).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from pipeline.llm.model.decoder import Decoder
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables


@dataclasses.dataclass(frozen=True)
class TextScore:
    perplexity: float
    tokens: int  # how many tokens were scored
    predictions: torch.Tensor  # the most likely next token at each scored position (for agreement)


@torch.inference_mode()
def score_windows(logits_of: Callable[[torch.Tensor], torch.Tensor], ids: list[int], window: int,
                  device: torch.device | str) -> TextScore:
    """Perplexity of `ids` and the top-1 predictions, windows of `window` tokens each scored from its
    second half on; `logits_of(tokens [1, window])` gives the logits [window, vocab] of any model."""
    nll, count, predictions = 0.0, 0, []
    for start in range(0, len(ids) - window + 1, window):
        tokens = torch.tensor([ids[start:start + window]], device=device)
        first = window // 2
        logprobs = torch.log_softmax(logits_of(tokens)[first - 1:-1].float(), dim=-1)
        targets = tokens[0, first:]
        nll -= float(logprobs.gather(1, targets[:, None]).sum())
        count += len(targets)
        predictions.append(logprobs.argmax(-1).cpu())
    if not count:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one window of {window}")
    return TextScore(math.exp(nll / count), count, torch.cat(predictions))


def score_text(model: Decoder, ids: list[int], window: int = 512) -> TextScore:
    """`score_windows` for our decoder (a fresh KV cache row per window)."""
    device = next(model.parameters()).device
    cache = KVCache(model.config, 1, window, next(model.parameters()).dtype, device)
    rope = RotaryTables(model.config, window, device)
    return score_windows(lambda tokens: model(cache, rope, (Prefill(0, 0),), tokens=tokens)[
        0, :, :model.config.vocab_size], ids, window, device)


def agreement(a: TextScore, b: TextScore) -> float:
    """The share of positions where both pick the same most likely next token."""
    return float((a.predictions == b.predictions).float().mean())
