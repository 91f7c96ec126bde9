"""The SAM engine seam: the two network calls every backend implements, and the torch ones.

`SegmentPipeline` does all image and prompt handling (`pipeline.sam.transforms`, caching, sessions)
and asks an engine only to encode a preprocessed image and to decode prompts against an embedding,
so the built engines (ONNX Runtime, TensorRT sessions: `SessionSamEngine`) plug in and nothing
else changes.

On a GPU one click is ~100 small kernels and an encode hundreds more: launched one by one they cost
more than they compute, so `GraphedSamEngine` replays captured CUDA graphs (one for the encoder,
one per prompt shape for the decoder). The CPU has no launch overhead to hide and runs eagerly.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
from torch import Tensor

from pipeline.cuda_graphs import CapturedCall
from pipeline.engine_session import Session
from pipeline.sam.mask_decoder import select_masks
from pipeline.sam.model import Sam, SamConfig
from pipeline.sam.prompt_encoder import labelled_points

Points = tuple[Tensor, Tensor]  # coordinates [B, N, 2] in model-input pixels, labels [B, N] (1 object, 0 background)


class SamEngine(Protocol):
    """What every SAM backend offers `SegmentPipeline`: one image encode, one prompt decode."""

    config: SamConfig
    device: torch.device  # where embeddings, prompts and masks live
    name: str  # the backend as a user reads it: "torch (CUDA graphs)", "torch (CPU)"
    precision: str  # the encoder's number format, e.g. "bfloat16"

    def encode(self, pixels: Tensor) -> Tensor:
        """Preprocessed pixels [1, 3, S, S] (`transforms.preprocess`) → float32 image embedding [1, C, S/16, S/16]."""
        ...

    def decode(self, embedding: Tensor, points: Points | None, box: Tensor | None, mask_input: Tensor | None,
               multimask: bool) -> tuple[Tensor, Tensor]:
        """Low-res mask logits [B, M, 256, 256] and IoU predictions [B, M] for B prompts in model-input
        pixels: points, a box [B, 4] (x0, y0, x1, y1), a previous low-res mask [B, 1, 256, 256] to refine."""
        ...


class TorchSamEngine:
    """Our `Sam` module run eagerly, on any device."""

    def __init__(self, model: Sam):
        self.model = model
        self.config = model.config
        self.device = model.device
        self.dtype = next(model.image_encoder.parameters()).dtype
        self.precision = str(self.dtype).removeprefix("torch.")
        self.name = f"torch ({self.device.type.upper()})"

    @torch.inference_mode()
    def encode(self, pixels: Tensor) -> Tensor:
        return self.model.image_encoder(pixels.to(self.device, self.dtype)).float()

    @torch.inference_mode()
    def decode(self, embedding: Tensor, points: Points | None, box: Tensor | None, mask_input: Tensor | None,
               multimask: bool) -> tuple[Tensor, Tensor]:
        return self.model.decode(embedding, points, box, mask_input, multimask)


class GraphedSamEngine(TorchSamEngine):
    """CUDA: the encoder and each single-prompt decoder shape (number of points, box or not, previous
    mask or not, multimask or not) are captured on first use and replayed. Calls are serialised by
    one lock, since a graph's inputs and outputs are buffers shared by every caller."""

    def __init__(self, model: Sam):
        super().__init__(model)
        self.name = "torch (CUDA graphs)"
        self._lock = threading.Lock()
        self._encoder: CapturedCall | None = None
        self._decoders: dict[tuple, CapturedCall] = {}
        self._pool = torch.cuda.graph_pool_handle()  # the decoder graphs share one memory pool

    @torch.inference_mode()
    def encode(self, pixels: Tensor) -> Tensor:
        with self._lock:
            x = pixels.to(self.device, self.dtype)
            self._encoder = self._encoder or CapturedCall(self.model.image_encoder, x)
            return self._encoder(x).float()

    @torch.inference_mode()
    def decode(self, embedding: Tensor, points: Points | None, box: Tensor | None, mask_input: Tensor | None,
               multimask: bool) -> tuple[Tensor, Tensor]:
        coords, labels = points if points is not None else (None, None)
        if coords is not None and coords.shape[0] > 1:
            # A batch of prompts (segment everything): its kernels are big enough to hide their launches,
            # and a graph would hold on to its large buffers for good.
            return super().decode(embedding, points, box, mask_input, multimask)
        key = (0 if coords is None else coords.shape[1], box is not None, mask_input is not None, multimask)
        with self._lock:
            if key not in self._decoders:
                def decode(e, c, lab, b, m):
                    return self.model.decode(e, (c, lab) if c is not None else None, b, m, multimask)

                self._decoders[key] = CapturedCall(decode, embedding, coords, labels, box, mask_input, pool=self._pool)
            return self._decoders[key](embedding, coords, labels, box, mask_input)


def torch_sam_engine(model: Sam) -> SamEngine:
    """Replayed CUDA graphs on a GPU, eager elsewhere."""
    return GraphedSamEngine(model) if model.device.type == "cuda" else TorchSamEngine(model)


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
