"""A built engine as its runtime loads it (ONNX Runtime, TensorRT): named input tensors in, output
tensors out. One shape for both runtimes, so each vision seam has one session-backed engine
(`pipeline.sam.engine.SessionSamEngine`, `pipeline.minigpt4.engine.SessionVisionEncoder`) and the
builders (`engine_builder`) hand over sessions without the pipelines importing them."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class Session(Protocol):
    device: torch.device  # where its outputs come back

    def run(self, feeds: dict[str, Tensor]) -> list[Tensor]:
        ...
