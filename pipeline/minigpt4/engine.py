"""The MiniGPT-4 vision engine seam: image pixels → the LLM prompt's query embeddings.

`ImageChatPipeline` preprocesses and caches; an engine only runs the network (EVA ViT-g,
Q-Former, projection), so the built engines (`SessionVisionEncoder`) plug in and the
pipeline does not change. On a GPU the encoder is ~600 small kernels whose launches cost more
than their math, so the torch engine replays it as one captured CUDA graph; the CPU runs eagerly.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
from torch import Tensor

from pipeline.cuda_graphs import CapturedCall
from pipeline.engine_session import Session
from pipeline.minigpt4.vision import MiniGPT4Vision, VisionConfig


class VisionEncoder(Protocol):
    """What every MiniGPT-4 vision backend offers `ImageChatPipeline`."""

    config: VisionConfig
    name: str  # the backend as a user reads it: "torch (CUDA graphs)", "torch (CPU)"

    def encode(self, pixels: Tensor) -> Tensor:
        """CLIP-normalised pixels [1, 3, 224, 224] → query embeddings [num_query, llm_width] on the
        engine's device, in its precision."""
        ...


class TorchVisionEncoder:
    """Our `MiniGPT4Vision` module: one replayed CUDA graph on a GPU, eager elsewhere."""

    def __init__(self, model: MiniGPT4Vision):
        self.model = model
        self.config = model.config
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.graphed = self.device.type == "cuda"
        self.name = "torch (CUDA graphs)" if self.graphed else f"torch ({self.device.type.upper()})"
        self._graph: CapturedCall | None = None
        self._lock = threading.Lock()  # the graph's input and output buffers are shared by every caller

    @torch.inference_mode()
    def encode(self, pixels: Tensor) -> Tensor:
        if not self.graphed:
            return self.model(pixels.to(self.device, self.dtype))[0]
        with self._lock:
            x = pixels.to(self.device, self.dtype)
            self._graph = self._graph or CapturedCall(self.model, x)
            return self._graph(x)[0]


class SessionVisionEncoder:
    """MiniGPT-4's vision side (EVA ViT-g + Q-Former + projection) on one built engine."""

    def __init__(self, config: VisionConfig, session: Session, name: str, precision: str, device: torch.device,
                 dtype: torch.dtype):
        self.config, self.session, self.name, self.precision = config, session, name, precision
        self.device, self.dtype = device, dtype  # where the LLM wants the embeddings

    @torch.inference_mode()
    def encode(self, pixels: Tensor) -> Tensor:
        return self.session.run({"pixels": pixels})[0][0].to(self.device, self.dtype)
