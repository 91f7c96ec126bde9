"""The vision engine seams (`SamEngine`, MiniGPT-4's `VisionEncoder`) over built engines.

Both runtimes (ONNX Runtime, TensorRT) load an engine as a `Session`: named input tensors in, output
tensors out. So one SAM engine and one MiniGPT-4 encoder serve either runtime, and they only
translate between the seam's arguments and the exported graphs' inputs (`onnx_export`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from pipeline.minigpt4.vision import VisionConfig
from pipeline.sam.engine import Points
from pipeline.sam.mask_decoder import select_masks
from pipeline.sam.model import SamConfig
from pipeline.sam.prompt_encoder import labelled_points


class Session(Protocol):
    device: torch.device  # where its outputs come back

    def run(self, feeds: dict[str, Tensor]) -> list[Tensor]:
        ...


class SessionSamEngine:
    """SAM on two built engines: the image encoder and the prompt encoder + mask decoder."""

    def __init__(self, config: SamConfig, encoder: Session, decoder: Session, name: str, precision: str):
        self.config, self.encoder, self.decoder = config, encoder, decoder
        self.device = decoder.device
        self.name, self.precision = name, precision

    @torch.inference_mode()
    def encode(self, pixels: Tensor) -> Tensor:
        return self.encoder.run({"pixels": pixels})[0].float()

    @torch.inference_mode()
    def decode(self, embedding: Tensor, points: Points | None, box: Tensor | None, mask_input: Tensor | None,
               multimask: bool) -> tuple[Tensor, Tensor]:
        prompt = labelled_points(points, box)
        if prompt is None:
            raise ValueError("the exported decoder needs at least one point or a box")
        coords, labels = prompt
        grid = 4 * self.config.embedding_size
        has_mask = torch.ones(1) if mask_input is not None else torch.zeros(1)
        masks, iou = self.decoder.run({
            "image_embeddings": embedding, "point_coords": coords, "point_labels": labels,
            "mask_input": mask_input if mask_input is not None else torch.zeros(1, 1, grid, grid),
            "has_mask_input": has_mask})
        return select_masks(masks.to(self.device), iou.to(self.device), multimask)


class SessionVisionEncoder:
    """MiniGPT-4's vision side (EVA ViT-g + Q-Former + projection) on one built engine."""

    def __init__(self, config: VisionConfig, session: Session, name: str, precision: str, device: torch.device,
                 dtype: torch.dtype):
        self.config, self.session, self.name, self.precision = config, session, name, precision
        self.device, self.dtype = device, dtype  # where the LLM wants the embeddings

    @torch.inference_mode()
    def encode(self, pixels: Tensor) -> Tensor:
        return self.session.run({"pixels": pixels})[0][0].to(self.device, self.dtype)
