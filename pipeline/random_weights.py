"""Random weights with a trained-like spread, for the built-in demo checkpoints.

Default initialisations leave norms at 1 and biases at 0, and relative-position tables at 0; a
little spread everywhere makes the demo models' outputs depend on their inputs.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def spread_weights(model: nn.Module, seed: int, std: float = 0.2) -> nn.Module:
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name.lower() and name.endswith("weight"):
            p.uniform_(0.5, 1.5)
        else:
            p.normal_(0, std)
    return model
