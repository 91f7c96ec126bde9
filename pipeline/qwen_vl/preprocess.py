"""Qwen2.5-VL's image preprocessing: an image → flat patches in the vision tower's order, and its grid.

As Qwen2-VL's image processor does it (the PIL version; the model was trained with the same steps):
1. resize (bicubic, on the 8-bit RGB image) to the nearest multiple of patch × merge on each side,
   scaled up or down so the pixel count stays within [min_pixels, max_pixels], aspect ratio kept;
2. rescale to [0, 1] and normalise by the CLIP mean and std;
3. cut into patch × patch squares, ordered merge window by merge window (the m × m patches that the
   merger will join into one LLM token are consecutive), each patch flattened as (channel, time,
   row, column) with the still image repeated to fill the temporal patch.
The grid is (t, h, w) in patches; an image is one temporal step (t = 1).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from pipeline.errors import UserError
from pipeline.images import normalise
from pipeline.weights_io import read_json

MAX_ASPECT = 200  # the processor refuses images more elongated than this


def first(*values: int | None) -> int | None:
    """The first value that is set (0 counts as set, as in the processor)."""
    return next((v for v in values if v is not None), None)


@dataclasses.dataclass(frozen=True)
class PreprocessConfig:
    """`preprocessor_config.json`'s settings; Qwen2VLImageProcessor's defaults where a key is left out."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] | None = (0.48145466, 0.4578275, 0.40821073)  # None (with std): no normalising
    image_std: tuple[float, ...] | None = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float | None = 1 / 255  # None: do_rescale off
    resample: int = Image.Resampling.BICUBIC

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merged cell of patches."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf(cls, cfg: dict) -> PreprocessConfig:
        """Top-level `min_pixels`/`max_pixels` (the hub's files) win over `size.shortest_edge`/`longest_edge`
        (newer files; the same two numbers under other names), as in the processor."""
        if not cfg.get("do_resize", True):
            raise UserError("preprocessor_config.json turns do_resize off; Qwen2.5-VL needs its sizes snapped "
                            "to the patch grid, so this is not supported")
        d, size = cls(), cfg.get("size") or {}
        normalize = cfg.get("do_normalize", True)
        return cls(
            patch_size=cfg.get("patch_size", d.patch_size),
            temporal_patch_size=cfg.get("temporal_patch_size", d.temporal_patch_size),
            merge_size=cfg.get("merge_size", d.merge_size),
            min_pixels=first(cfg.get("min_pixels"), size.get("shortest_edge"), d.min_pixels),
            max_pixels=first(cfg.get("max_pixels"), size.get("longest_edge"), d.max_pixels),
            image_mean=tuple(cfg.get("image_mean", d.image_mean)) if normalize else None,
            image_std=tuple(cfg.get("image_std", d.image_std)) if normalize else None,
            rescale_factor=cfg.get("rescale_factor", d.rescale_factor) if cfg.get("do_rescale", True) else None,
            resample=int(cfg.get("resample", d.resample)))

    @classmethod
    def from_folder(cls, folder: Path) -> PreprocessConfig:
        """From `preprocessor_config.json` (the hub's folders), else the `image_processor` entry of
        `processor_config.json` (where transformers 5 writes it), else the processor's defaults."""
        folder = Path(folder)
        if (folder / "preprocessor_config.json").is_file():
            return cls.from_hf(read_json(folder / "preprocessor_config.json"))
        if (folder / "processor_config.json").is_file():
            return cls.from_hf(read_json(folder / "processor_config.json").get("image_processor") or {})
        return cls()


@dataclasses.dataclass(frozen=True)
class Patches:
    """One image ready for the vision tower: `pixels` [t*h*w, 3*T*P*P] float32 and its `grid` (t, h, w)."""

    pixels: Tensor
    grid: tuple[int, int, int]


def token_count(grid: tuple[int, int, int], merge_size: int = 2) -> int:
    """LLM positions an image of this patch grid takes: each merge × merge cell becomes one token."""
    t, h, w = grid
    return t * h * w // merge_size ** 2


def smart_resize(height: int, width: int, c: PreprocessConfig) -> tuple[int, int]:
    """Step 1's size. Float operations in the processor's order: a boundary case must round the same way."""
    if min(height, width) < 1:
        raise UserError(f"the image is empty ({height}×{width} pixels)")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise UserError(f"the image is {height}×{width} pixels: more than {MAX_ASPECT} times longer than wide, "
                        f"which Qwen2.5-VL does not take; crop it")
    f = c.factor
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > c.max_pixels:
        beta = math.sqrt((height * width) / c.max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < c.min_pixels:
        beta = math.sqrt(c.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    if h < f or w < f:  # only with min_pixels at 0: a side rounded to nothing
        raise UserError(f"the image is {height}×{width} pixels: too small to make one {f}×{f} cell; "
                        f"raise min_pixels or give a larger image")
    return h, w


def patchify(x: np.ndarray, c: PreprocessConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[3, H, W] → [h*w, 3*T*P*P]: merge cells row-major, patches row-major inside a cell, each patch
    (channel, time, row, column) with the image repeated over time."""
    channels, height, width = x.shape
    p, m, t = c.patch_size, c.merge_size, c.temporal_patch_size
    h, w = height // p, width // p
    cells = x.reshape(channels, h // m, m, p, w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(cells[:, :, :, :, :, None], (*cells.shape[:5], t, p, p))
    return frames.reshape(h * w, channels * t * p * p), (1, h, w)


def preprocess(image: np.ndarray, c: PreprocessConfig) -> Patches:
    """A uint8 image, RGB [H, W, 3] or grayscale [H, W] (`pipeline.images.load_image` makes one of
    anything) → its patches and grid."""
    if image.dtype != np.uint8 or not (image.ndim == 2 or image.ndim == 3 and image.shape[2] == 3):
        raise UserError(f"expected a uint8 image [H, W, 3] or [H, W], got {image.dtype} {tuple(image.shape)}")
    height, width = smart_resize(image.shape[0], image.shape[1], c)
    picture = Image.fromarray(np.ascontiguousarray(image)).convert("RGB")
    pixels, grid = patchify(normalise(picture.resize((width, height), c.resample), c.rescale_factor, c.image_mean, c.image_std), c)
    return Patches(torch.from_numpy(pixels), grid)
