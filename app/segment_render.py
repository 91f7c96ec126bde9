"""Drawing for the Segment tab: masks, prompts and candidates on the image, masks as PNG files.

Presentation only, kept out of `pipeline/` (which does the model work). Drawing happens on the
display copy at browser size, so a click on a 40-MP photo costs no more to show than on a small one.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

from pipeline.images import fit_for_display, to_device
from pipeline.segment import AutoMask
from pipeline.segment_session import SegmentSession

MASK_COLOUR = np.array([30, 144, 255], dtype=np.float32)
EVERYTHING_COLOURS = np.random.default_rng(7).integers(40, 255, (256, 3)).astype(np.float32)
THUMBNAIL = 256  # the candidates' longest side, in pixels


def tint(image: np.ndarray, mask: np.ndarray, device: str | torch.device = "cpu") -> np.ndarray:
    """The image with the mask tinted, blended by torch on `device` (the GPU where there is one:
    numpy's masked blend of a 1600×1200 copy takes ~0.1 s on one CPU core)."""
    x, m = to_device(image, device), to_device(mask, device)[..., None]
    blended = x.float() * 0.45 + torch.as_tensor(MASK_COLOUR, device=device) * 0.55
    return torch.where(m, blended.to(torch.uint8), x).contiguous().cpu().numpy()


def render_overlay(image: np.ndarray, mask: np.ndarray | None, points: Sequence[Sequence[float]] = (),
                   labels: Sequence[int] = (), box: Sequence[float] | None = None,
                   device: str | torch.device = "cpu") -> np.ndarray:
    """The image with the mask tinted, positive points green, negative red, and the box outlined."""
    canvas = Image.fromarray(tint(image, mask, device) if mask is not None else image)
    draw = ImageDraw.Draw(canvas)
    r = max(4, round(max(image.shape[:2]) / 120))
    if box is not None:
        draw.rectangle(list(box), outline=(255, 200, 0), width=max(2, r // 2))
    for (x, y), label in zip(points, labels):
        draw.ellipse([x - r, y - r, x + r, y + r], fill=(0, 200, 70) if label == 1 else (230, 40, 40),
                     outline=(255, 255, 255), width=max(1, r // 3))
    return np.asarray(canvas)


def render_everything(image: np.ndarray, masks: Sequence[AutoMask]) -> np.ndarray:
    """Every mask in its own colour, largest first so small ones stay visible on top; masks at the
    original size are shrunk to the image's."""
    out = image.astype(np.float32)
    for i, m in enumerate(sorted(masks, key=lambda m: -int(m.mask.sum()))):
        mask = shrink(m.mask, image)
        out[mask] = out[mask] * 0.4 + EVERYTHING_COLOURS[i % 256] * 0.6
    return out.astype(np.uint8)


def mask_png(mask: np.ndarray) -> bytes:
    """A mask as a black-and-white PNG (255 = object), the format image editors expect; fast
    compression (a mask is mostly runs, so it stays small) keeps a 12 MP mask quick to write."""
    buf = io.BytesIO()
    Image.fromarray(mask.astype(np.uint8) * 255).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def shrink(mask: np.ndarray | None, like: np.ndarray) -> np.ndarray | None:
    """A full-size mask at the display copy's size (nearest neighbour keeps it binary)."""
    if mask is None or mask.shape == like.shape[:2]:
        return mask
    return np.asarray(Image.fromarray(mask).resize((like.shape[1], like.shape[0]), Image.NEAREST))


def render_session(s: SegmentSession, display: np.ndarray, scale: float,
                   device: str | torch.device = "cpu") -> np.ndarray:
    """The display copy (`scale` displayed pixels per original pixel) with the chosen mask, the points,
    a half-drawn box's first corner and the box."""
    corner = [s.corner] if s.corner is not None else []
    points = [[v * scale for v in point] for point in [*s.prompts.points, *corner]]
    labels = [*s.prompts.labels, *[1] * len(corner)]
    box = [v * scale for v in s.prompts.box] if s.prompts.box is not None else None
    return render_overlay(display, shrink(s.mask, display), points, labels, box, device)


def thumbnail(display: np.ndarray) -> np.ndarray:
    """The copy the candidates are drawn on (made once per image, not per click)."""
    return fit_for_display(display, THUMBNAIL)[0]


def render_candidates(s: SegmentSession, small: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """(thumbnail, caption) for each candidate mask on the `thumbnail` copy, the chosen one ticked."""
    if s.prediction is None:
        return []
    return [(render_overlay(small, shrink(m, small)), f"{'✓ ' if i == s.chosen else ''}#{i + 1} · IoU {score:.2f}")
            for i, (m, score) in enumerate(zip(s.prediction.masks, s.prediction.scores))]


def status_line(s: SegmentSession) -> str:
    """What the user has prompted, and what their own session cost."""
    st, n = s.stats, len(s.prompts.points)
    return (f"{n} point{'' if n == 1 else 's'}{' + box' if s.prompts.box is not None else ''} · "
            f"encoder runs {st.encoder_runs} (last {st.last_encoder_ms:.0f} ms), cached embeddings reused "
            f"{st.cache_hits}× · decoder {st.last_decoder_ms:.1f} ms")
