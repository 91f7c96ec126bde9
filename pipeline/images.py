"""Turning whatever a user uploads into an RGB uint8 array, or a clear message why not.

Shared by the image tools: the size is checked from the file header before decoding (so a
20000×20000 PNG is refused without allocating it), EXIF rotation is applied, and every mode
(grayscale, palette, RGBA, 16-bit, float, CMYK) ends up as 8-bit RGB.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import os
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError

from pipeline.errors import UserError

MAX_PIXELS = 64_000_000  # about 8000×8000; larger photos are almost always mistakes or bombs
MIN_SIDE = 16
HASH_CHUNK = 4 << 20  # a 12 MP photo is 36 MB of pixels: nine chunks hashed at once
_HASHERS = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                 thread_name_prefix="image-hash")


def _to_rgb(img: Image.Image) -> np.ndarray:
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # 16-bit / 32-bit grayscale: stretch to 8 bits
        arr = np.asarray(img, dtype=np.float64)
        top = arr.max()
        gray = (arr / top * 255 if top > 0 else arr).clip(0, 255).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=2)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")  # transparent areas shown on white, as a viewer would
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(background, rgba).convert("RGB"))
    return np.asarray(img.convert("RGB"))


def load_image(source: str | Path | bytes | np.ndarray | Image.Image) -> np.ndarray:
    """RGB uint8 [H, W, 3] from a path, bytes, a PIL image or an array; `UserError` when unusable."""
    if isinstance(source, np.ndarray):
        if source.ndim == 2:
            source = np.repeat(source[..., None], 3, axis=2)
        if source.ndim != 3 or source.shape[2] not in (3, 4):
            raise UserError(f"expected an H×W×3 image array, got shape {source.shape}")
        source = Image.fromarray(source.astype(np.uint8) if source.dtype != np.uint8 else source)
    if isinstance(source, Image.Image):
        img = source
    else:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        except FileNotFoundError:
            raise UserError(f"image file {source} does not exist") from None
        except Image.DecompressionBombError as e:
            raise UserError(f"the image is too large to open safely: {e}") from None
        except (UnidentifiedImageError, OSError) as e:
            raise UserError(f"this file is not an image we can read ({type(e).__name__}); "
                            f"use PNG, JPEG, WebP, BMP or TIFF") from None
    w, h = img.size
    if w * h > MAX_PIXELS:
        raise UserError(f"the image is too large: {w}×{h} ({w * h / 1e6:.0f} MP); the limit is "
                        f"{MAX_PIXELS / 1e6:.0f} MP — downscale it first")
    if min(w, h) < MIN_SIDE:
        raise UserError(f"the image is only {w}×{h} pixels; it needs at least {MIN_SIDE}×{MIN_SIDE}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = ImageOps.exif_transpose(img)
            return np.ascontiguousarray(_to_rgb(img))
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt pixel data
        raise UserError(f"the image file is damaged and cannot be decoded ({e})") from None


def content_key(image: np.ndarray) -> str:
    """What identifies an image's pixels (the tools' embedding caches are keyed by it): SHA-1 over
    chunks hashed in parallel (hashlib releases the GIL), then over their digests, plus the shape."""
    data = memoryview(np.ascontiguousarray(image)).cast("B")
    chunks = [data[i:i + HASH_CHUNK] for i in range(0, len(data), HASH_CHUNK)]
    digests = _HASHERS.map(lambda chunk: hashlib.sha1(chunk).digest(), chunks)
    return hashlib.sha1(b"".join(digests)).hexdigest() + "-" + "x".join(map(str, image.shape))


def to_device(image: np.ndarray | torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """The array (or tensor) as a tensor on `device`, without a host copy (decoded images are read-only
    arrays, which torch only warns about: nothing here writes to them)."""
    if isinstance(image, torch.Tensor):
        return image.to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(image).to(device)


def to_host(x: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy array in host memory. From a GPU it is copied into page-locked memory, which
    the copy engine fills two to three times faster than pageable memory (a 1600×1200 drawn copy is
    5.8 MB per Segment click); torch caches those blocks, and the array keeps its block alive."""
    if x.device.type != "cuda":
        return x.numpy()
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    out.copy_(x)  # blocking: the array is complete when returned
    return out.numpy()


PIL_PRECISION_BITS = 22  # Pillow's fixed point for 8-bit resampling (32 - 8 - 2 bits, Resample.c)


def _pil_bilinear_weights(n_in: int, n_out: int, device: torch.device) -> torch.Tensor:
    """Pillow's bilinear resampling of one axis as a matrix [n_out, n_in] of its fixed-point coefficients: the
    triangle filter widened by the scale where shrinking, each output's taps normalised to sum 1, then rounded
    to `PIL_PRECISION_BITS` (the steps of Pillow's `precompute_coeffs` and `normalize_coeffs_8bpc`)."""
    scale = n_in / n_out
    widen = max(scale, 1.0)
    support = widen  # the triangle's support, 1, widened
    weights = np.zeros((n_out, n_in))
    for out in range(n_out):
        center = (out + 0.5) * scale
        first, last = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), n_in)
        taps = np.maximum(0.0, 1.0 - np.abs((np.arange(first, last) - center + 0.5) * (1.0 / widen)))
        total = sum(taps.tolist())  # added in order, as Pillow does
        if total:
            taps /= total
        weights[out, first:last] = np.trunc(taps * (1 << PIL_PRECISION_BITS) + 0.5)
    return torch.tensor(weights, dtype=torch.float64, device=device)


def resize_like_pil(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """RGB uint8 [H, W, 3] → float [3, h, w] at `size`, equal to Pillow's bilinear resize (what SAM's reference
    preprocessing does, through torchvision's `to_pil_image` and `resize`): Pillow itself on the CPU; elsewhere
    its fixed-point passes (across, then down, each rounded and clipped to 8 bits) as float64 products, exact for
    these integers, so a big photo is still resized on the GPU."""
    if image.device.type == "cpu":
        resized = Image.fromarray(image.numpy()).resize(size[::-1], Image.BILINEAR)
        return torch.from_numpy(np.array(resized)).permute(2, 0, 1).float()
    return pil_bilinear_passes(image, size)


def pil_bilinear_passes(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """`resize_like_pil` off the CPU: Pillow's two fixed-point passes on the image's device."""
    half, one = float(1 << (PIL_PRECISION_BITS - 1)), float(1 << PIL_PRECISION_BITS)
    x = image.permute(2, 0, 1).double()  # [3, H, W]
    if size[1] != x.shape[2]:
        x = ((x @ _pil_bilinear_weights(x.shape[2], size[1], x.device).T + half) / one).floor_().clamp_(0, 255)
    if size[0] != x.shape[1]:
        x = ((_pil_bilinear_weights(x.shape[1], size[0], x.device) @ x + half) / one).floor_().clamp_(0, 255)
    return x.float()


def resize_image(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """RGB uint8 [H, W, 3] (on any device) → float [3, h, w] at `size`: bilinear with antialiasing,
    rounded to whole levels, within one level of PIL's 8-bit bilinear resize."""
    x = image.permute(2, 0, 1)[None].float()
    return F.interpolate(x, size, mode="bilinear", antialias=True, align_corners=False)[0].round_().clamp_(0, 255)


def fit_for_display(image: np.ndarray, max_side: int = 1600,
                    device: str | torch.device = "cpu") -> tuple[np.ndarray, float]:
    """A copy no larger than `max_side` for the browser, and its scale (displayed / original pixels);
    resized on `device` (a GPU resizes a 12 MP photo in well under a millisecond, PIL takes ~0.1 s)."""
    h, w = image.shape[:2]
    scale = min(1.0, max_side / max(h, w))
    if scale == 1.0:
        return image, 1.0
    size = (max(1, round(h * scale)), max(1, round(w * scale)))
    if torch.device(device).type == "cpu":
        return np.asarray(Image.fromarray(image).resize(size[::-1], Image.BILINEAR)), scale
    small = resize_image(to_device(image, device), size)
    return to_host(small.to(torch.uint8).permute(1, 2, 0).contiguous()), scale  # contiguous: PIL copies strided arrays slowly


def masked_crop(image: np.ndarray, mask: np.ndarray, margin: float = 0.15, dim: float = 0.3) -> np.ndarray:
    """The part of `image` (RGB uint8 [H, W, 3]) around `mask` (bool [H, W]), with `margin` of the
    object's size around it and everything outside the mask dimmed to `dim` of its brightness: what
    image chat is asked about when a user asks about a selected object (the surroundings stay
    visible, faintly, so the object keeps its context)."""
    if mask.shape != image.shape[:2]:
        raise UserError(f"the mask is {mask.shape[1]}×{mask.shape[0]} but the image is "
                        f"{image.shape[1]}×{image.shape[0]}: they must be the same size")
    ys, xs = np.nonzero(mask)
    if not len(ys):
        raise UserError("the mask is empty: select an object first")
    h, w = mask.shape
    pad_y, pad_x = int((ys.max() - ys.min() + 1) * margin), int((xs.max() - xs.min() + 1) * margin)
    y0, y1 = max(0, ys.min() - pad_y), min(h, ys.max() + 1 + pad_y)
    x0, x1 = max(0, xs.min() - pad_x), min(w, xs.max() + 1 + pad_x)
    crop, keep = image[y0:y1, x0:x1], mask[y0:y1, x0:x1, None]
    return np.where(keep, crop, (crop * dim).astype(np.uint8))


def asked_picture(image: str | Path | bytes | np.ndarray, mask: str | Path | bytes | np.ndarray | None) -> np.ndarray:
    """The picture an image-chat request asks about: the image, or the object its `mask` whites out (a crop)."""
    try:
        pixels = load_image(image)
    except UserError as e:
        raise UserError(f"the image: {e}", "image") from None
    if mask is None:
        return pixels
    try:
        return masked_crop(pixels, load_image(mask).max(axis=2) > 127)
    except UserError as e:
        raise UserError(f"the mask: {e}", "mask") from None


def normalise(image: Image.Image, rescale: float | None, mean: tuple[float, ...] | None,
              std: tuple[float, ...] | None) -> np.ndarray:
    """[3, H, W] float32 as the transformers image processors make it: scaled in float64 and rounded to
    float32 once, then (x - mean) / std in float32 (None: that step off)."""
    x = np.asarray(image).astype(np.float64)
    x = (x * rescale if rescale is not None else x).astype(np.float32)
    if mean is not None:
        x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return x.transpose(2, 0, 1)
