"""Random weights with a trained-like spread, for the built-in demo checkpoints.

Default initialisations leave norms at 1 and biases at 0, and relative-position tables at 0; a
little spread everywhere makes the demo models' outputs depend on their inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


@torch.no_grad()
def spread_weights(build: Callable[[], nn.Module], seed: int, std: float = 0.2) -> nn.Module:
    """`build()` with every parameter redrawn from `seed`. The seed is set before building, so random
    buffers (SAM's positional Gaussian matrix) are the same whatever ran before: the demo checkpoint
    must not depend on which test or tool made it first."""
    torch.manual_seed(seed)
    model = build()
    for name, p in model.named_parameters():
        if "norm" in name.lower() and name.endswith("weight"):
            p.uniform_(0.5, 1.5)
        else:
            p.normal_(0, std)
    return model
