"""SAM's image pre- and post-processing: pure functions of the configuration, outside the model.

Every engine (torch eager, CUDA graphs, ONNX Runtime, TensorRT) runs only the two network
calls — encode a padded, normalised image; decode prompts into low-res masks — so resizing,
normalising, padding and upscaling live here once and behave the same whichever engine runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.images import resize_like_pil
from pipeline.sam.model import PIXEL_MEAN, PIXEL_STD


def input_size(size: tuple[int, int], target: int) -> tuple[int, int]:
    """(h, w) after resizing the longest side to `target`, as SAM was trained."""
    h, w = size
    scale = target / max(h, w)
    return int(h * scale + 0.5), int(w * scale + 0.5)


def resize_longest(image: Tensor, target: int) -> Tensor:
    """RGB uint8 [H, W, 3] (on the engine's device: a big photo is resized there, not on the CPU)
    → float [3, h, w] with its longest side `target`, resized exactly as SAM's reference code resizes it."""
    return resize_like_pil(image, input_size(image.shape[:2], target))


def preprocess(image: Tensor, img_size: int) -> Tensor:
    """[3, h, w] RGB 0..255 (longest side already `img_size`) → normalised, padded [1, 3, S, S] float32."""
    mean = torch.tensor(PIXEL_MEAN, device=image.device).view(-1, 1, 1)
    std = torch.tensor(PIXEL_STD, device=image.device).view(-1, 1, 1)
    x = (image.float() - mean) / std
    h, w = x.shape[-2:]
    return F.pad(x, (0, img_size - w, 0, img_size - h))[None]


def upscale_masks(low_res: Tensor, img_size: int, resized: tuple[int, int], original: tuple[int, int]) -> Tensor:
    """Low-res logits [B, M, h, w] → logits at the original image size (undo padding, then resizing)."""
    masks = F.interpolate(low_res, (img_size, img_size), mode="bilinear", align_corners=False)
    masks = masks[..., :resized[0], :resized[1]]
    return F.interpolate(masks, original, mode="bilinear", align_corners=False)
