"""Scratch buffers for the Triton kernels' fp32 partial sums (the decode attention's splits, the
batch-invariant GEMM's split-K), kept for good: a captured CUDA graph keeps their addresses.

One dict of buffers per engine (`using_workspaces`): two engines' steps, on two streams at once, must not
write each other's partials. Within one stream, kernels share a buffer safely: each reads its partials
back before the next kernel starts.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import Tensor

_workspaces: contextvars.ContextVar[dict[tuple, Tensor]] = contextvars.ContextVar("kernel_workspaces", default={})


@contextlib.contextmanager
def using_workspaces(buffers: dict[tuple, Tensor]) -> Iterator[None]:
    """Within it, the partials come from `buffers` (an engine's own dict; outside it: one dict shared by all
    callers)."""
    token = _workspaces.set(buffers)
    try:
        yield
    finally:
        _workspaces.reset(token)


def workspace(device: torch.device, numel: int) -> Tensor:
    """An fp32 buffer of at least `numel` elements, one per (device, power-of-two size), kept forever."""
    key, buffers = (str(device), 1 << max(0, numel - 1).bit_length()), _workspaces.get()
    if key not in buffers:
        buffers[key] = torch.empty(key[1], dtype=torch.float32, device=device)
    return buffers[key]
