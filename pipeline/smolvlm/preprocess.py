"""SmolVLM's image preprocessing: an RGB image → tiles of the vision encoder's size, plus a global view.

As Idefics3's image processor does it (its PIL version, the one SmolVLM was trained with):
1. resize (Lanczos) so the longest edge is `size.longest_edge` (up or down; the other edge keeps the
   aspect ratio, rounded down then up to even; nothing past 4096);
2. resize again so both edges are multiples of the tile side (`max_image_size.longest_edge`);
3. cut that into rows × cols tiles, row-major, and append the whole image resized to one tile (the
   global view); an image that is a single tile is only the global view (rows = cols = 0);
4. rescale to [0, 1] and normalise each tile by the mean and std.
Every resize works on the 8-bit image, and each tile is sent whole (its pixel mask is all ones). The
tiles' order is the prompt's order of their `<row_r_col_c>` runs (`prompt.py`).
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

MAX_SIDE = 4096  # the processor never resizes an edge past this


@dataclasses.dataclass(frozen=True)
class PreprocessConfig:
    """`preprocessor_config.json`'s settings; Idefics3's defaults where a key is left out."""

    longest_edge: int = 4 * 364  # size.longest_edge: step 1's target
    tile: int = 364  # max_image_size.longest_edge: the vision encoder's input side
    split: bool = True  # do_image_splitting; off: the image is only squashed to one tile
    resize: bool = True  # do_resize (step 1)
    resample: int = Image.Resampling.LANCZOS
    rescale: float | None = 1 / 255  # None: do_rescale off
    mean: tuple[float, ...] | None = (0.5, 0.5, 0.5)  # None (with std): do_normalize off
    std: tuple[float, ...] | None = (0.5, 0.5, 0.5)

    @classmethod
    def from_hf(cls, cfg: dict) -> PreprocessConfig:
        d = cls()
        normalize = cfg.get("do_normalize", True)
        return cls(
            longest_edge=(cfg.get("size") or {}).get("longest_edge", d.longest_edge),
            tile=(cfg.get("max_image_size") or {}).get("longest_edge", d.tile),
            split=cfg.get("do_image_splitting", d.split), resize=cfg.get("do_resize", d.resize),
            resample=int(cfg.get("resample", d.resample)),
            rescale=cfg.get("rescale_factor", d.rescale) if cfg.get("do_rescale", True) else None,
            mean=tuple(cfg.get("image_mean", d.mean)) if normalize else None,
            std=tuple(cfg.get("image_std", d.std)) if normalize else None)

    @classmethod
    def from_folder(cls, folder: Path) -> PreprocessConfig:
        """From `preprocessor_config.json` (the hub's SmolVLM folders), else the `image_processor` entry of
        `processor_config.json` (where transformers 5 writes it)."""
        folder = Path(folder)
        if (folder / "preprocessor_config.json").is_file():
            return cls.from_hf(read_json(folder / "preprocessor_config.json"))
        if (folder / "processor_config.json").is_file():
            return cls.from_hf(read_json(folder / "processor_config.json").get("image_processor") or {})
        raise UserError(f"no preprocessor_config.json in {folder}: SmolVLM's image sizes are not known")


@dataclasses.dataclass(frozen=True)
class ImageTiles:
    """One image ready for the vision encoder: `pixels` [T, 3, tile, tile] float32, `pixel_mask`
    [T, tile, tile] (1: a real pixel), the tile grid (rows × cols, then the global view; 0 × 0: the
    global view alone)."""

    pixels: Tensor
    pixel_mask: Tensor
    rows: int
    cols: int


def fit_longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    """Step 1's size: the longest edge becomes `longest`, the other follows the aspect ratio (truncated,
    then made even), at least 1; then both are brought under `MAX_SIDE`."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / aspect)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def fit_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """Step 2's size: the longer edge rounded up to whole tiles, the shorter one from the aspect ratio,
    then rounded up to whole tiles too."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def split_tiles(image: Image.Image, c: PreprocessConfig) -> tuple[list[Image.Image], int, int]:
    """Steps 2–3: the tiles row-major, then the global view; (rows, cols) of the grid, 0 × 0 for none."""
    t = c.tile
    if not c.split:
        return [image.resize((t, t), c.resample)], 0, 0
    height, width = fit_tiles(image.height, image.width, t)
    image = image.resize((width, height), c.resample)
    if height <= t and width <= t:
        return [image], 0, 0
    rows, cols = height // t, width // t
    tiles = [image.crop((col * t, row * t, (col + 1) * t, (row + 1) * t)) for row in range(rows) for col in range(cols)]
    return tiles + [image.resize((t, t), c.resample)], rows, cols


def preprocess(image: np.ndarray, c: PreprocessConfig) -> ImageTiles:
    """An RGB uint8 image [H, W, 3] (`pipeline.images.load_image` makes one of anything) → its tiles."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise UserError(f"expected an RGB uint8 image [H, W, 3], got {image.dtype} {tuple(image.shape)}")
    picture = Image.fromarray(np.ascontiguousarray(image))
    if c.resize:
        height, width = fit_longest_edge(picture.height, picture.width, c.longest_edge)
        picture = picture.resize((width, height), c.resample)
    tiles, rows, cols = split_tiles(picture, c)
    pixels = torch.from_numpy(np.stack([normalise(tile, c.rescale, c.mean, c.std) for tile in tiles]))
    mask = torch.ones(pixels.shape[0], pixels.shape[2], pixels.shape[3], dtype=torch.int64)
    return ImageTiles(pixels, mask, rows, cols)
