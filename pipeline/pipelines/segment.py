"""SegmentPipeline: SAM's heavy image encoder once per image, its light decoder once per click.

Embeddings are cached by image content (LRU, bounded in bytes), so every click, undo or box on
an image already seen costs only the prompt encoder and mask decoder. Prompts are given in the
original image's pixels and masks come back at the original size. The network calls go through a
`SamEngine` (torch here; other backends plug in the same way); this module does the rest, which is
the same for every engine. Work is counted into the caller's `SegmentStats` (a user's session, an
API request), never into process-wide counters that every user would see.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from pipeline.errors import UserError
from pipeline.images import content_key, to_device
from pipeline.sam.engine import SamEngine
from pipeline.sam.transforms import input_size, preprocess, resize_longest, upscale_masks

DISPLAY_COPIES = 8  # display copies kept on the GPU: a thousand open sessions must not hold 5.8 MB each


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
    mask_tensor: torch.Tensor  # bool [M, h, w] on the engine's device, at the size asked for (else the original)
    scores: np.ndarray  # predicted IoU [M]
    low_res_logits: np.ndarray  # [M, 256, 256]: feed one back as `mask_input` to refine

    @functools.cached_property
    def masks(self) -> np.ndarray:
        """The masks in host memory, copied on first use: a UI that draws on the GPU never copies them."""
        return self.mask_tensor.cpu().numpy()


@dataclasses.dataclass
class SegmentStats:
    """The work done for one caller: encoder runs, embeddings served from the cache, latest timings."""

    encoder_runs: int = 0
    cache_hits: int = 0
    last_encoder_ms: float = 0.0
    last_decoder_ms: float = 0.0


SAM_SIZES_BY_WIDTH = {768: "ViT-B", 1024: "ViT-L", 1280: "ViT-H"}  # the official releases' encoder widths


class SegmentPipeline:
    def __init__(self, engine: SamEngine, cache_bytes: int = 512 << 20, is_demo: bool = False):
        """`engine` runs SAM (see `studio.backends.sam_engine`); the pipeline does the rest."""
        self.engine = engine
        self.is_demo = is_demo
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._display: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.everything_grid = 32 if self.engine.device.type == "cuda" else 12
        c = self.engine.config
        encoder = "MobileSAM (TinyViT)" if c.tiny_vit is not None else f"SAM {c.encoder_embed_dim}-wide ViT ×{c.encoder_depth}"
        # what a user calls it (the header); the engine's terms in the description (the start-up details)
        self.title = "demo SAM (random weights)" if is_demo else "MobileSAM" if c.tiny_vit is not None else \
            f"SAM {SAM_SIZES_BY_WIDTH.get(c.encoder_embed_dim, 'ViT')}"
        self.description = f"{encoder} · {self.engine.name} · {self.engine.precision}"

    def close(self) -> None:
        """Free the SAM engine and the cached embeddings (the tool is being unloaded); a session that
        still holds this pipeline moves to the reloaded one (`SegmentSession.rebind`)."""
        with self._lock:
            self.engine = None
            self._cache.clear()
            self._display.clear()

    def held_bytes(self) -> int:
        """Device memory in this pipeline's caches (embeddings, display copies): it counts in the
        memory budget on top of what the load measured."""
        # no lock: an encode holds it for a while, and a copy of the values is taken atomically
        return sum(t.nbytes for t in [*self._cache.values(), *self._display.values()])

    def display_copy(self, handle: ImageHandle, display: np.ndarray) -> torch.Tensor:
        """The UI's display copy of `handle`'s image on the engine's device, kept for the most recently
        used DISPLAY_COPIES images so a click copies nothing in; another is uploaded again on its
        next click (~0.5 ms). Keyed by content: two users on one photo share one copy."""
        key = (handle.key, display.shape)
        with self._lock:
            if key not in self._display:
                self._display[key] = to_device(display, self.engine.device)
                while len(self._display) > DISPLAY_COPIES:
                    self._display.popitem(last=False)
            self._display.move_to_end(key)
            return self._display[key]

    @property
    def closed(self) -> bool:
        return self.engine is None

    def set_image(self, image: np.ndarray, stats: SegmentStats | None = None) -> ImageHandle:
        """Encode `image` (RGB uint8 [H, W, 3]) unless its embedding is cached; returns its handle."""
        handle = ImageHandle(content_key(image), image)
        self._embedding(handle, stats or SegmentStats())
        return handle

    def _embedding(self, handle: ImageHandle, stats: SegmentStats) -> torch.Tensor:
        with self._lock:  # held while encoding: two users sending the same new image encode it once
            if handle.key in self._cache:
                self._cache.move_to_end(handle.key)
                stats.cache_hits += 1
                return self._cache[handle.key]
            start = time.perf_counter()
            device = self.engine.device
            pixels = resize_longest(to_device(handle.image, device), self.engine.config.img_size)
            try:
                embedding = self.engine.encode(preprocess(pixels, self.engine.config.img_size))
            except torch.OutOfMemoryError:
                raise UserError("the GPU ran out of memory encoding this image; close other tools or "
                                "use a smaller SAM variant") from None
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # not the device: see `plugins.cuda_streams`
            stats.encoder_runs += 1
            stats.last_encoder_ms = (time.perf_counter() - start) * 1e3
            self._cache[handle.key] = embedding
            while len(self._cache) > 1 and sum(e.nbytes for e in self._cache.values()) > self.cache_bytes:
                self._cache.popitem(last=False)
            return embedding

    @torch.inference_mode()
    def predict(self, handle: ImageHandle, points: Sequence[Sequence[float]] = (), labels: Sequence[int] = (),
                box: Sequence[float] | None = None, mask_input: np.ndarray | None = None,
                multimask: bool = True, stats: SegmentStats | None = None,
                size: tuple[int, int] | None = None) -> Prediction:
        """Masks for points (x, y) with labels 1 = object / 0 = background, and/or a box (x0, y0, x1, y1),
        all in original-image pixels; `mask_input` is a previous `low_res_logits[i]` to refine. Masks
        come at `size` (height, width: what the UI shows), else at the original size."""
        stats = stats or SegmentStats()
        h, w = handle.size
        check_prompts(points, labels, box, (h, w))
        embedding = self._embedding(handle, stats)
        start = time.perf_counter()
        img_size, device = self.engine.config.img_size, self.engine.device
        ih, iw = input_size((h, w), img_size)
        scale = torch.tensor([iw / w, ih / h], device=device)
        point_args = None
        if len(points):
            coords = torch.tensor([points], dtype=torch.float32, device=device) * scale
            point_args = (coords, torch.tensor([labels], dtype=torch.int64, device=device))
        box_arg = (torch.tensor([box], dtype=torch.float32, device=device).view(1, 2, 2) * scale).view(1, 4) \
            if box is not None else None
        mask_arg = None
        if mask_input is not None:
            mask_arg = torch.as_tensor(mask_input, dtype=torch.float32, device=device).reshape(1, 1, 256, 256)
        low_res, scores = self.engine.decode(embedding, point_args, box_arg, mask_arg, multimask)
        masks = upscale_masks(low_res, img_size, (ih, iw), size or (h, w)) > 0.0
        result = Prediction(masks[0], scores[0].float().cpu().numpy(), low_res[0].float().cpu().numpy())
        stats.last_decoder_ms = (time.perf_counter() - start) * 1e3
        return result

    @torch.inference_mode()
    def full_size_mask(self, handle: ImageHandle, low_res_logits: np.ndarray) -> np.ndarray:
        """One mask at the original size (for a download) from its `Prediction.low_res_logits` row."""
        h, w = handle.size
        img_size = self.engine.config.img_size
        logits = torch.as_tensor(low_res_logits, dtype=torch.float32, device=self.engine.device)[None, None]
        return (upscale_masks(logits, img_size, input_size((h, w), img_size), (h, w)) > 0)[0, 0].cpu().numpy()

    @torch.inference_mode()
    def segment_everything(self, handle: ImageHandle, points_per_side: int | None = None, min_score: float = 0.88,
                           min_stability: float = 0.92, nms_iou: float = 0.7, batch: int = 64,
                           stats: SegmentStats | None = None, size: tuple[int, int] | None = None) -> list[AutoMask]:
        """Masks for a grid of single-point prompts, kept when SAM is confident and the mask is
        stable (barely changes when the logit threshold moves by ±1), duplicates removed by NMS.
        The grid is 32×32 on a GPU, 12×12 on the CPU (each point costs a decoder pass)."""
        points_per_side = points_per_side or self.everything_grid
        h, w = handle.size
        embedding = self._embedding(handle, stats or SegmentStats())
        img_size, device = self.engine.config.img_size, self.engine.device
        ih, iw = input_size((h, w), img_size)
        steps = (torch.arange(points_per_side, device=device) + 0.5) / points_per_side
        grid = torch.stack(torch.meshgrid(steps * iw, steps * ih, indexing="xy"), -1).reshape(-1, 1, 2)
        logits, scores = [], []
        for chunk in grid.split(batch):
            labels = torch.ones(chunk.shape[:2], dtype=torch.int64, device=device)
            low, iou = self.engine.decode(embedding, (chunk, labels), None, None, True)
            logits.append(low.flatten(0, 1))
            scores.append(iou.flatten())
        logits, scores = torch.cat(logits), torch.cat(scores).float()
        stability = (logits > 1).flatten(1).sum(1) / (logits > -1).flatten(1).sum(1).clamp(min=1)
        keep = (scores > min_score) & (stability > min_stability) & (logits > 0).flatten(1).any(1)
        logits, scores, stability = logits[keep], scores[keep], stability[keep]
        if not len(logits):
            return []
        kept = box_nms(mask_boxes(logits > 0), scores, nms_iou)
        masks = torch.cat([upscale_masks(logits[idx][:, None], img_size, (ih, iw), size or (h, w)) > 0
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


def check_prompts(points: Sequence[Sequence[float]], labels: Sequence[int], box: Sequence[float] | None,
                  size: tuple[int, int]) -> None:
    """Clear messages for prompts SAM cannot use: none at all, or outside the image."""
    h, w = size
    if not len(points) and box is None:
        raise UserError("add a point (click on the object) or draw a box first")
    if len(points) != len(labels):
        raise UserError(f"{len(points)} points but {len(labels)} labels")
    for (x, y), label in zip(points, labels):
        check_point(x, y, size)
        if label not in (0, 1):
            raise UserError(f"point label must be 1 (object) or 0 (background), got {label!r}")
    if box is not None:
        x0, y0, x1, y1 = box
        if not (0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h):
            raise UserError(f"box ({x0:.0f}, {y0:.0f}, {x1:.0f}, {y1:.0f}) must lie inside the {w}×{h} image "
                            f"with x0 < x1 and y0 < y1")


def check_point(x: float, y: float, size: tuple[int, int]) -> None:
    """A clear message for a point (a click, a box corner) outside the (height, width) image."""
    h, w = size
    if not (0 <= x < w and 0 <= y < h):
        raise UserError(f"point ({x:.0f}, {y:.0f}) is outside the {w}×{h} image")
