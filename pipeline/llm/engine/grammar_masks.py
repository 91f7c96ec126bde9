"""A batch's grammar masks: which tokens each constrained row may draw next, as bits, from its matcher.

While the GPU runs a step's forward pass, the sampler has `fill_masks` compute the constrained rows' masks on the
host (in parallel threads), uploads them in one asynchronous copy and applies them with `apply_masks` on the
device: the host never waits for the GPU for it. Rows without a grammar keep their logits as they were, and a
batch without any grammar row does none of this.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.llm.text.grammar import Grammar

_executor = None


def fill_masks(grammars: list[Grammar | None], bitmask: Tensor) -> None:
    """Write each row's allowed next tokens into the host `bitmask` [len(grammars), words] (int32, one
    bit per token), the rows' grammars computed in parallel: a row without a grammar allows every token;
    a complete grammar allows only the end ids (a matcher in error ends the reply the same way)."""
    import llguidance
    import llguidance.torch

    global _executor
    jobs = []
    for row, grammar in enumerate(grammars):
        if grammar is None:
            bitmask[row] = -1
        elif grammar.matcher.is_error():
            bitmask[row] = torch.tensor(grammar.ends, dtype=torch.int32)
        else:
            jobs.append((grammar.matcher, row))
    if jobs:
        _executor = _executor or llguidance.LLExecutor()
        llguidance.torch.fill_next_token_bitmask_par(_executor, jobs, bitmask)


def apply_masks(logits: Tensor, bitmask: Tensor) -> Tensor:
    """`logits` [B, vocab] with the tokens `bitmask` [B, words] (on the logits' device) forbids set to
    -inf; a row whose bits are all set comes back unchanged."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :logits.shape[-1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))
