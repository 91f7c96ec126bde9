"""Drawing for the Segment tab: masks, prompts and candidates on the image, masks as PNG files.

Presentation only, kept out of `pipeline/` (which does the model work). Drawing happens on the
display copy at browser size, so a click on a 40-MP photo costs no more to show than on a small one.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from pipeline.images import fit_for_display, to_device, to_host
from pipeline.pipelines.segment import AutoMask
from pipeline.pipelines.segment_session import SegmentSession

MASK_COLOUR = np.array([30, 144, 255], dtype=np.float32)
EVERYTHING_COLOURS = np.random.default_rng(7).integers(40, 255, (256, 3)).astype(np.float32)
THUMBNAIL = 256  # the candidates' longest side, in pixels


POSITIVE_COLOUR, NEGATIVE_COLOUR, OUTLINE, BOX_COLOUR = (0, 200, 70), (230, 40, 40), (255, 255, 255), (255, 200, 0)


@functools.lru_cache(maxsize=64)
def _colour(colour: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A colour as a tensor on `device`, made once: a copy from host memory mid-drawing would make the
    host wait for the GPU's queued kernels."""
    return torch.tensor(colour, dtype=dtype, device=device)


def _paint(canvas: torch.Tensor, where: torch.Tensor, colour: Sequence[int]) -> None:
    """`colour` where `where` holds, in place (a select, not a boolean index: no wait for the GPU)."""
    canvas.copy_(torch.where(where[..., None], _colour(tuple(colour), torch.uint8, canvas.device), canvas))


def _disc(canvas: torch.Tensor, x: float, y: float, r: int, colour: Sequence[int], outline: int) -> None:
    """A filled disc with a white rim, touching only the pixels around it (a few small kernels)."""
    h, w = canvas.shape[:2]
    x0, x1, y0, y1 = max(0, int(x) - r - 1), min(w, int(x) + r + 2), max(0, int(y) - r - 1), min(h, int(y) + r + 2)
    if x0 >= x1 or y0 >= y1:
        return
    ys = torch.arange(y0, y1, device=canvas.device, dtype=torch.float32)[:, None] + 0.5
    xs = torch.arange(x0, x1, device=canvas.device, dtype=torch.float32)[None] + 0.5
    d2 = (xs - x) ** 2 + (ys - y) ** 2
    window = canvas[y0:y1, x0:x1]
    _paint(window, d2 <= r * r, OUTLINE)
    _paint(window, d2 <= (r - outline) ** 2, colour)


def _frame(canvas: torch.Tensor, box: Sequence[float], width: int) -> None:
    h, w = canvas.shape[:2]
    x0, y0, x1, y1 = (max(0, min(int(round(v)), limit)) for v, limit in zip(box, (w, h, w, h)))
    colour = _colour(BOX_COLOUR, torch.uint8, canvas.device)
    canvas[y0:min(y0 + width, y1), x0:x1] = colour
    canvas[max(y1 - width, y0):y1, x0:x1] = colour
    canvas[y0:y1, x0:min(x0 + width, x1)] = colour
    canvas[y0:y1, max(x1 - width, x0):x1] = colour


def render_overlay(image: np.ndarray | torch.Tensor, mask: np.ndarray | torch.Tensor | None, points: Sequence[Sequence[float]] = (),
                   labels: Sequence[int] = (), box: Sequence[float] | None = None,
                   device: str | torch.device = "cpu") -> np.ndarray:
    """The image with the mask tinted, positive points green, negative red, and the box outlined, all
    drawn by torch on `device` (the GPU where there is one) and copied out once: numpy's masked blend
    of a 1600×1200 copy takes ~0.1 s on one CPU core, and PIL's drawing costs two more full copies.
    Given tensors already on `device` (the Segment tab keeps its display copy and masks there), a click
    copies nothing in."""
    canvas = to_device(image, device)
    if mask is not None:
        blended = (canvas.float() * 0.45 + _colour(tuple(MASK_COLOUR.tolist()), torch.float32, canvas.device) * 0.55
                   ).to(torch.uint8)
        canvas = torch.where(to_device(mask, device)[..., None], blended, canvas)
    else:
        canvas = canvas.clone()
    r = max(4, round(max(image.shape[:2]) / 120))
    if box is not None:
        _frame(canvas, box, max(2, r // 2))
    for (x, y), label in zip(points, labels):
        _disc(canvas, x, y, r, POSITIVE_COLOUR if label == 1 else NEGATIVE_COLOUR, max(1, r // 3))
    return to_host(canvas)


def render_everything(image: np.ndarray, masks: Sequence[AutoMask]) -> np.ndarray:
    """Every mask in its own colour, largest first so small ones stay visible on top; masks at the
    original size are shrunk to the image's."""
    out = image.astype(np.float32)
    for i, m in enumerate(sorted(masks, key=lambda m: -int(m.mask.sum()))):
        mask = shrink(m.mask, image)
        out[mask] = out[mask] * 0.4 + EVERYTHING_COLOURS[i % 256] * 0.6
    return out.astype(np.uint8)


def png_bytes(image: np.ndarray) -> bytes:
    """An array as PNG; fast compression keeps a 12 MP image quick to write."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def mask_png(mask: np.ndarray) -> bytes:
    """A mask as a black-and-white PNG (255 = object), the format image editors expect (a mask is mostly
    runs, so it stays small)."""
    return png_bytes(mask.astype(np.uint8) * 255)


def shrink(mask: np.ndarray | torch.Tensor | None, like: np.ndarray | torch.Tensor
           ) -> np.ndarray | torch.Tensor | None:
    """Masks ([h, w] or [M, h, w], numpy or a tensor on its device) at the size of the image `like`,
    nearest neighbour with pixel centres aligned as PIL's (the masks stay binary), as the type given."""
    if mask is None or tuple(mask.shape[-2:]) == tuple(like.shape[:2]):
        return mask
    t = mask if isinstance(mask, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(mask))
    batch = t.reshape(-1, 1, *t.shape[-2:]).to(torch.uint8)
    out = F.interpolate(batch, size=tuple(like.shape[:2]), mode="nearest-exact").bool().reshape(
        *t.shape[:-2], *like.shape[:2])
    return out if isinstance(mask, torch.Tensor) else out.numpy()


def render_session(s: SegmentSession, display: np.ndarray | torch.Tensor, scale: float,
                   device: str | torch.device = "cpu") -> np.ndarray:
    """The display copy (`scale` displayed pixels per original pixel) with the chosen mask, the points,
    a half-drawn box's first corner and the box."""
    corner = [s.corner] if s.corner is not None else []
    points = [[v * scale for v in point] for point in [*s.prompts.points, *corner]]
    labels = [*s.prompts.labels, *[1] * len(corner)]
    box = [v * scale for v in s.prompts.box] if s.prompts.box is not None else None
    mask = shrink(s.prediction.mask_tensor[s.chosen], display) if s.prediction is not None else None
    return render_overlay(display, mask, points, labels, box, device)


def thumbnail(display: np.ndarray) -> np.ndarray:
    """The copy the candidates are drawn on (made once per image, not per click)."""
    return fit_for_display(display, THUMBNAIL)[0]


def render_candidates(s: SegmentSession, small: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """(thumbnail, caption) for each candidate mask on the `thumbnail` copy, the chosen one ticked; drawn
    where the masks are (the GPU), so only the thumbnails come back."""
    if s.prediction is None:
        return []
    masks = s.prediction.mask_tensor
    small_masks, canvas = shrink(masks, small), to_device(small, masks.device)
    return [(render_overlay(canvas, m, device=masks.device),
             f"{'✓ ' if i == s.chosen else ''}#{i + 1} · quality {quality(score):.2f}")
            for i, (m, score) in enumerate(zip(small_masks, s.prediction.scores))]


def quality(score: float) -> float:
    """SAM's predicted IoU as a 0–1 quality: the raw value can run past either end (−0.9 reads as an error);
    the API keeps the raw scores."""
    return min(max(float(score), 0.0), 1.0)


# The page's demo banner is decided as it is built; a demo SAM that runs because MobileSAM could not be
# downloaded (offline) is said here, beside every mask.
DEMO_STATUS = "**Demo SAM with random weights: these masks mean nothing** (MobileSAM downloads when online) · "


def status_line(s: SegmentSession, verbose: bool = False) -> str:
    """What the user has prompted (and why there is nothing to download, where the chosen mask is
    empty), and what their own session cost: in a user's words, and with `verbose` in the engine's."""
    st, n = s.stats, len(s.prompts.points)
    empty = " · the chosen mask is empty: nothing to download or ask about" if s.mask is not None and \
        not s.mask.any() else ""
    demo = DEMO_STATUS if s.pipeline.is_demo else ""
    half_box = " · box: now click its opposite corner" if s.corner is not None else ""
    box = " + box" if s.prompts.box is not None else ""
    cost = (f"encoder runs {st.encoder_runs} (last {st.last_encoder_ms:.0f} ms), cached embeddings reused "
            f"{st.cache_hits}× · decoder {st.last_decoder_ms:.1f} ms") if verbose else \
        (f"picture read {st.encoder_runs}×" + (f" (last in {st.last_encoder_ms / 1e3:.1f} s)" if st.encoder_runs else "")
         + (f", reused {st.cache_hits}×" if st.cache_hits else "") + f" · each click {st.last_decoder_ms:.0f} ms")
    return f"{demo}{n} point{'' if n == 1 else 's'}{box}{half_box}{empty} · {cost}"
