"""SegmentPipeline: SAM's heavy image encoder once per image, its light decoder once per click.

Embeddings are cached by image content (LRU, bounded in bytes), so every click, undo or box on
an image already seen costs only the prompt encoder and mask decoder. Prompts are given in the
original image's pixels and masks come back at the original size.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from pipeline.cuda_graphs import CapturedCall
from pipeline.errors import UserError
from pipeline.sam.graphed_decoder import GraphedDecoder
from pipeline.sam.model import load_sam


@dataclasses.dataclass(frozen=True)
class ImageHandle:
    """An image the pipeline has seen: its content key, and the pixels to re-encode if evicted."""

    key: str
    image: np.ndarray = dataclasses.field(repr=False, compare=False)

    @property
    def size(self) -> tuple[int, int]:
        """(height, width)"""
        return self.image.shape[0], self.image.shape[1]


@dataclasses.dataclass
class Prediction:
    masks: np.ndarray  # bool [M, H, W] at the original size
    scores: np.ndarray  # predicted IoU [M]
    low_res_logits: np.ndarray  # [M, 256, 256]: feed one back as `mask_input` to refine
    decoder_ms: float


@dataclasses.dataclass
class SegmentStats:
    encoder_runs: int = 0
    cache_hits: int = 0
    last_encoder_ms: float = 0.0
    last_decoder_ms: float = 0.0


def input_size(size: tuple[int, int], target: int) -> tuple[int, int]:
    """(h, w) after resizing the longest side to `target`, as SAM was trained."""
    h, w = size
    scale = target / max(h, w)
    return int(h * scale + 0.5), int(w * scale + 0.5)


class SegmentPipeline:
    def __init__(self, checkpoint: Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 cache_bytes: int = 512 << 20, is_demo: bool = False):
        self.model = load_sam(checkpoint, device=device, dtype=dtype)
        self.dtype = dtype
        self.is_demo = is_demo
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = SegmentStats()
        self.everything_grid = 32 if self.model.device.type == "cuda" else 12
        # Clicks replay captured CUDA graphs on a GPU (launch overhead dominates a click); eager elsewhere.
        self._decode = GraphedDecoder(self.model) if self.model.device.type == "cuda" else self.model.decode
        self._graphed_encoder: CapturedCall | None = None
        c = self.model.config
        self.description = (f"SAM {c.encoder_embed_dim}-wide ViT ×{c.encoder_depth} · torch · {device} · "
                            f"{str(dtype).removeprefix('torch.')}")

    def set_image(self, image: np.ndarray) -> ImageHandle:
        """Encode `image` (RGB uint8 [H, W, 3]) unless its embedding is cached; returns its handle."""
        key = hashlib.sha1(np.ascontiguousarray(image).data).hexdigest() + f"-{image.shape[0]}x{image.shape[1]}"
        handle = ImageHandle(key, image)
        self._embedding(handle)
        return handle

    @torch.inference_mode()
    def _embedding(self, handle: ImageHandle) -> torch.Tensor:
        with self._lock:
            if handle.key in self._cache:
                self._cache.move_to_end(handle.key)
                self.stats.cache_hits += 1
                return self._cache[handle.key]
            start = time.perf_counter()
            h, w = input_size(handle.size, self.model.config.img_size)
            resized = np.array(Image.fromarray(handle.image).resize((w, h), Image.BILINEAR))
            pixels = torch.from_numpy(resized).to(self.model.device).permute(2, 0, 1)
            x = self.model.preprocess(pixels).to(self.dtype)
            try:
                if self.model.device.type == "cuda":  # Python launches leave the GPU idle: replay a graph
                    self._graphed_encoder = self._graphed_encoder or CapturedCall(self.model.image_encoder, x)
                    embedding = self._graphed_encoder(x).float()
                else:
                    embedding = self.model.image_encoder(x).float()
            except torch.OutOfMemoryError:
                raise UserError("the GPU ran out of memory encoding this image; close other tools or "
                                "use a smaller SAM variant") from None
            if self.model.device.type == "cuda":
                torch.cuda.synchronize()
            self.stats.encoder_runs += 1
            self.stats.last_encoder_ms = (time.perf_counter() - start) * 1e3
            self._cache[handle.key] = embedding
            while len(self._cache) > 1 and sum(e.nbytes for e in self._cache.values()) > self.cache_bytes:
                self._cache.popitem(last=False)
            return embedding

    @torch.inference_mode()
    def predict(self, handle: ImageHandle, points: Sequence[Sequence[float]] = (), labels: Sequence[int] = (),
                box: Sequence[float] | None = None, mask_input: np.ndarray | None = None,
                multimask: bool = True) -> Prediction:
        """Masks for points (x, y) with labels 1 = object / 0 = background, and/or a box (x0, y0, x1, y1),
        all in original-image pixels; `mask_input` is a previous `low_res_logits[i]` to refine."""
        h, w = handle.size
        check_prompts(points, labels, box, (h, w))
        embedding = self._embedding(handle)
        start = time.perf_counter()
        ih, iw = input_size((h, w), self.model.config.img_size)
        scale = torch.tensor([iw / w, ih / h], device=self.model.device)
        device = self.model.device
        point_args = None
        if len(points):
            coords = torch.tensor([points], dtype=torch.float32, device=device) * scale
            point_args = (coords, torch.tensor([labels], dtype=torch.int64, device=device))
        box_arg = (torch.tensor([box], dtype=torch.float32, device=device).view(1, 2, 2) * scale).view(1, 4) \
            if box is not None else None
        mask_arg = None
        if mask_input is not None:
            mask_arg = torch.as_tensor(mask_input, dtype=torch.float32, device=device).reshape(1, 1, 256, 256)
        with self._lock:
            low_res, scores = self._decode(embedding, point_args, box_arg, mask_arg, multimask)
            masks = self.model.upscale_masks(low_res, (ih, iw), (h, w)) > 0.0
            result = Prediction(masks[0].cpu().numpy(), scores[0].float().cpu().numpy(),
                                low_res[0].float().cpu().numpy(), (time.perf_counter() - start) * 1e3)
            self.stats.last_decoder_ms = result.decoder_ms
        return result

    @torch.inference_mode()
    def segment_everything(self, handle: ImageHandle, points_per_side: int | None = None, min_score: float = 0.88,
                           min_stability: float = 0.92, nms_iou: float = 0.7, batch: int = 64) -> list[AutoMask]:
        """Masks for a grid of single-point prompts, kept when SAM is confident and the mask is
        stable (barely changes when the logit threshold moves by ±1), duplicates removed by NMS.
        The grid is 32×32 on a GPU, 12×12 on the CPU (each point costs a decoder pass)."""
        points_per_side = points_per_side or self.everything_grid
        h, w = handle.size
        embedding = self._embedding(handle)
        ih, iw = input_size((h, w), self.model.config.img_size)
        device = self.model.device
        steps = (torch.arange(points_per_side, device=device) + 0.5) / points_per_side
        grid = torch.stack(torch.meshgrid(steps * iw, steps * ih, indexing="xy"), -1).reshape(-1, 1, 2)
        logits, scores = [], []
        with self._lock:
            for chunk in grid.split(batch):
                labels = torch.ones(chunk.shape[:2], dtype=torch.int64, device=device)
                low, iou = self.model.decode(embedding, (chunk, labels), None, None, True)
                logits.append(low.flatten(0, 1))
                scores.append(iou.flatten())
        logits, scores = torch.cat(logits), torch.cat(scores).float()
        stability = (logits > 1).flatten(1).sum(1) / (logits > -1).flatten(1).sum(1).clamp(min=1)
        keep = (scores > min_score) & (stability > min_stability) & (logits > 0).flatten(1).any(1)
        logits, scores, stability = logits[keep], scores[keep], stability[keep]
        if not len(logits):
            return []
        kept = box_nms(mask_boxes(logits > 0), scores, nms_iou)
        masks = torch.cat([self.model.upscale_masks(logits[idx][:, None], (ih, iw), (h, w)) > 0
                           for idx in kept.split(16)])
        return [AutoMask(m[0].cpu().numpy(), scores[i].item(), stability[i].item()) for m, i in zip(masks, kept)
                if m.any()]  # a mask only in the padding is empty once cropped


@dataclasses.dataclass
class AutoMask:
    mask: np.ndarray  # bool [H, W]
    score: float  # predicted IoU
    stability: float


def box_nms(boxes: torch.Tensor, scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices of boxes (x0, y0, x1, y1) kept by greedy non-maximum suppression, best first."""
    order = scores.argsort(descending=True)
    boxes = boxes[order].float()
    area = (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)
    lt = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
    rb = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    iou = inter / (area[:, None] + area[None, :] - inter).clamp(min=1e-6)
    suppressed = torch.zeros(len(boxes), dtype=torch.bool)
    keep = []
    for i in range(len(boxes)):
        if not suppressed[i]:
            keep.append(i)
            suppressed |= iou[i].cpu() > threshold
    return order[torch.tensor(keep, dtype=torch.long)]


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """Tight boxes (x0, y0, x1, y1) of boolean masks [N, H, W]; empty masks give zero boxes."""
    n, h, w = masks.shape
    rows, cols = masks.any(2), masks.any(1)
    ys, xs = torch.arange(h, device=masks.device), torch.arange(w, device=masks.device)
    y0 = torch.where(rows, ys, h).amin(1)
    y1 = torch.where(rows, ys, -1).amax(1) + 1
    x0 = torch.where(cols, xs, w).amin(1)
    x1 = torch.where(cols, xs, -1).amax(1) + 1
    return torch.stack([x0, y0, x1, y1], 1).clamp(min=0) * masks.flatten(1).any(1, keepdim=True)


EVERYTHING_COLOURS = np.random.default_rng(7).integers(40, 255, (256, 3)).astype(np.float32)


def render_everything(image: np.ndarray, masks: Sequence[AutoMask]) -> np.ndarray:
    """Every mask in its own colour, largest first so small ones stay visible on top."""
    out = image.astype(np.float32)
    for i, m in enumerate(sorted(masks, key=lambda m: -int(m.mask.sum()))):
        out[m.mask] = out[m.mask] * 0.4 + EVERYTHING_COLOURS[i % 256] * 0.6
    return out.astype(np.uint8)


def check_prompts(points: Sequence[Sequence[float]], labels: Sequence[int], box: Sequence[float] | None,
                  size: tuple[int, int]) -> None:
    """Clear messages for prompts SAM cannot use: none at all, or outside the image."""
    h, w = size
    if not len(points) and box is None:
        raise UserError("add a point (click on the object) or draw a box first")
    if len(points) != len(labels):
        raise UserError(f"{len(points)} points but {len(labels)} labels")
    for (x, y), label in zip(points, labels):
        if not (0 <= x < w and 0 <= y < h):
            raise UserError(f"point ({x:.0f}, {y:.0f}) is outside the {w}×{h} image")
        if label not in (0, 1):
            raise UserError(f"point label must be 1 (object) or 0 (background), got {label!r}")
    if box is not None:
        x0, y0, x1, y1 = box
        if not (0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h):
            raise UserError(f"box ({x0:.0f}, {y0:.0f}, {x1:.0f}, {y1:.0f}) must lie inside the {w}×{h} image "
                            f"with x0 < x1 and y0 < y1")


MASK_COLOUR = np.array([30, 144, 255], dtype=np.float32)


def render_overlay(image: np.ndarray, mask: np.ndarray | None, points: Sequence[Sequence[float]] = (),
                   labels: Sequence[int] = (), box: Sequence[float] | None = None) -> np.ndarray:
    """The image with the mask tinted, positive points green, negative red, and the box outlined."""
    out = image.astype(np.float32)
    if mask is not None:
        out[mask] = out[mask] * 0.45 + MASK_COLOUR * 0.55
    canvas = Image.fromarray(out.astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    r = max(4, round(max(image.shape[:2]) / 120))
    if box is not None:
        draw.rectangle(list(box), outline=(255, 200, 0), width=max(2, r // 2))
    for (x, y), label in zip(points, labels):
        draw.ellipse([x - r, y - r, x + r, y + r], fill=(0, 200, 70) if label == 1 else (230, 40, 40),
                     outline=(255, 255, 255), width=max(1, r // 3))
    return np.asarray(canvas)


def mask_png(mask: np.ndarray) -> bytes:
    """A mask as a black-and-white PNG (255 = object), the format image editors expect."""
    buf = io.BytesIO()
    Image.fromarray(mask.astype(np.uint8) * 255).save(buf, format="PNG")
    return buf.getvalue()
