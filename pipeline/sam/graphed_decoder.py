"""SAM's per-click work (prompt encoder + mask decoder) replayed as CUDA graphs.

One click is ~100 small kernels: launched one by one they cost more than they compute. A graph
per prompt shape (number of points, box or not, previous mask or not, multimask or not) is
captured on first use.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.cuda_graphs import CapturedCall
from pipeline.sam.model import Sam


class GraphedDecoder:
    """Drop-in for `Sam.decode` on CUDA; call it under one lock (the graphs share buffers)."""

    def __init__(self, model: Sam):
        self.model = model
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, CapturedCall] = {}

    def __call__(self, embedding: Tensor, points: tuple[Tensor, Tensor] | None, box: Tensor | None,
                 mask: Tensor | None, multimask: bool) -> tuple[Tensor, Tensor]:
        coords, labels = points if points is not None else (None, None)
        key = (0 if coords is None else coords.shape[1], box is not None, mask is not None, multimask)
        if key not in self.graphs:
            def decode(e, c, lab, b, m):
                return self.model.decode(e, (c, lab) if c is not None else None, b, m, multimask)

            self.graphs[key] = CapturedCall(decode, embedding, coords, labels, box, mask, pool=self.pool)
        return self.graphs[key](embedding, coords, labels, box, mask)
