"""The KV cache: every layer's keys and values for a fixed number of rows, at fixed addresses."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pipeline.llm.weights.config import DecoderConfig


class KVCache:
    """Keys and values [layers, rows, kv_heads, max_seq, head_dim] at fixed addresses (graphable).

    A row holds one sequence. The engine keeps the rows of running requests first, so a batched
    decode step reads rows 0..B-1 as a plain view, and moves a row with `swap_rows` when a
    request joins or leaves (a copy of the filled part, once per event, not per step).
    """

    def __init__(self, config: DecoderConfig, rows: int, max_seq: int, dtype: torch.dtype, device):
        shape = (config.num_layers, rows, config.num_kv_heads, max_seq, config.head_dim)
        self.k, self.v = (_zeros(shape, dtype, torch.device(device)) for _ in range(2))
        self.rows, self.max_seq = rows, max_seq

    @staticmethod
    def row_bytes(config: DecoderConfig, max_seq: int, dtype: torch.dtype) -> int:
        return 2 * config.num_layers * config.num_kv_heads * max_seq * config.head_dim * dtype.itemsize

    def swap_rows(self, a: int, b: int, length: int) -> None:
        """Exchange the first `length` positions of rows a and b in every layer."""
        if a == b or length == 0:
            return
        for t in (self.k, self.v):
            held = t[:, a, :, :length].clone()
            t[:, a, :, :length] = t[:, b, :, :length]
            t[:, b, :, :length] = held


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros; on the CPU from the OS's zeroed pages (calloc): resident as chats fill them, not all at once."""
    cpu = device.type == "cpu" and dtype == torch.float32
    return torch.from_numpy(np.zeros(shape, np.float32)) if cpu else torch.zeros(shape, dtype=dtype, device=device)
