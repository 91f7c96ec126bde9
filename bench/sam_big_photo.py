"""SAM ViT-H on a 12 MP photo (4032×3024), through `SegmentPipeline` and the Segment tab's drawing.

Ours: the pixels hashed in parallel chunks, uploaded once and resized on the GPU, masks made at the
size the UI shows (1600 px), the display copy resized on the GPU. Reference in the same run: the
previous path (one SHA-1 over the pixels, PIL resize on the CPU, masks at full size copied to the
CPU and shrunk for display, the display copy resized by PIL). Random weights at real shapes, bf16,
captured CUDA graphs. Prints a table; writes sam_big_photo.json to $OUT.
"""

from __future__ import annotations

import hashlib
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import report  # noqa: E402
from app.segment_render import (MASK_COLOUR, mask_png, render_candidates, render_overlay, render_session, shrink,
                                thumbnail)  # noqa: E402
from studio.backends import sam_engine  # noqa: E402
from pipeline.images import fit_for_display, to_device  # noqa: E402
from pipeline.sam.model import VARIANTS, Sam, load_sam  # noqa: E402
from pipeline.sam.transforms import input_size, preprocess, upscale_masks  # noqa: E402
from pipeline.pipelines.segment import SegmentPipeline  # noqa: E402
from pipeline.pipelines.segment_session import SegmentSession  # noqa: E402
from pipeline.weights_io import write_weight_file  # noqa: E402

POINT = [[2000.0, 1500.0]]


def median_ms(fn, runs: int = 15) -> float:
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def previous_render(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The numpy blend the Segment tab used before."""
    out = image.astype(np.float32)
    out[mask] = out[mask] * 0.45 + MASK_COLOUR * 0.55
    return out.astype(np.uint8)


def photo() -> np.ndarray:
    """A 12 MP photo-like image: smooth shapes plus sensor noise."""
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(small).resize((4032, 3024), Image.BICUBIC)).astype(np.int16)
    return np.clip(base + rng.integers(-6, 7, base.shape), 0, 255).astype(np.uint8)


def main() -> None:
    torch.manual_seed(0)
    model = Sam(VARIANTS["vit_h"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "rel_pos" in name:
                p.normal_(0, 0.02)
    with tempfile.TemporaryDirectory() as tmp:
        write_weight_file(Path(tmp) / "sam_vit_h.pth", model.state_dict())
        seg = SegmentPipeline(sam_engine(load_sam(Path(tmp) / "sam_vit_h.pth", device="cuda", dtype=torch.bfloat16)))
    image = photo()
    engine, size = seg.engine, 1024
    display, scale = fit_for_display(image, device="cuda")
    shown = display.shape[:2]
    seg.predict(seg.set_image(image), POINT, [1], size=shown)  # capture graphs

    def ours_first():
        seg._cache.clear()
        handle = seg.set_image(image)
        return seg.predict(handle, POINT, [1], size=shown)

    def previous_first():
        hashlib.sha1(np.ascontiguousarray(image).data).hexdigest()
        h, w = input_size(image.shape[:2], size)
        pixels = torch.from_numpy(np.array(Image.fromarray(image).resize((w, h), Image.BILINEAR))).cuda()
        embedding = engine.encode(preprocess(pixels.permute(2, 0, 1).float(), size))
        coords = torch.tensor([POINT], device="cuda") * torch.tensor([w / 4032, h / 3024], device="cuda")
        low, _ = engine.decode(embedding, (coords, torch.ones(1, 1, dtype=torch.int64, device="cuda")), None, None, True)
        return (upscale_masks(low, size, (h, w), image.shape[:2]) > 0).cpu().numpy()

    handle = seg.set_image(image)
    draw = [[x * scale for x in POINT[0]]]
    session = SegmentSession(seg, image, shown)
    on_device = to_device(display, "cuda")  # the Segment tab keeps its display copy on the device

    def ours_click():
        """What the tab does per click: the session's step, then the chosen mask drawn (one copy out)."""
        session.clear()
        session.click(*POINT[0])
        return render_session(session, on_device, scale, "cuda")

    def previous_click():
        result = seg.predict(handle, POINT, [1])
        return previous_render(display, shrink(result.masks[int(np.argmax(result.scores))], display))

    full = seg.predict(handle, POINT, [1])
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "photo": "4032x3024", "shown": f"{shown[1]}x{shown[0]}"}
    res["upload->first mask ms: previous"] = round(median_ms(previous_first, 9), 1)
    res["upload->first mask ms: ours"] = round(median_ms(ours_first, 9), 1)
    res["upload->first mask: previous / ours"] = round(res["upload->first mask ms: previous"] /
                                                       res["upload->first mask ms: ours"], 2)
    res["display copy ms: PIL"] = round(median_ms(lambda: fit_for_display(image), 5), 1)
    res["display copy ms: GPU"] = round(median_ms(lambda: fit_for_display(image, device="cuda"), 9), 1)
    res["click incl. drawn mask ms: previous"] = round(median_ms(previous_click), 2)
    res["click incl. drawn mask ms: ours"] = round(median_ms(ours_click), 2)
    res["click: previous / ours"] = round(res["click incl. drawn mask ms: previous"] /
                                          res["click incl. drawn mask ms: ours"], 2)
    res["click: predict at shown size ms"] = round(median_ms(lambda: seg.predict(handle, POINT, [1], size=shown)), 2)
    shown_mask = seg.predict(handle, POINT, [1], size=shown).mask_tensor[0]
    res["click: drawing on the GPU ms"] = round(median_ms(lambda: render_overlay(on_device, shown_mask, draw, [1],
                                                                               device="cuda")), 2)
    res["click: drawing with numpy (previous) ms"] = round(median_ms(
        lambda: previous_render(display, shown_mask.cpu().numpy())), 2)
    drawn = ours_click()
    for fmt in ("PNG", "JPEG"):  # what the tab sends the browser per click: Gradio writes the drawn copy
        res[f"click: drawn copy encoded as {fmt} ms"] = round(median_ms(
            lambda: Image.fromarray(drawn).save(io.BytesIO(), fmt), 5), 1)
    small = thumbnail(display)
    res["click: candidate thumbnails ms"] = round(median_ms(lambda: render_candidates(session, small)), 2)
    res["click: the tab's whole step (drawn copy + thumbnails) ms"] = round(median_ms(
        lambda: (ours_click(), render_candidates(session, small))), 2)
    res["download mask (full size + PNG) ms"] = round(median_ms(
        lambda: mask_png(seg.full_size_mask(handle, full.low_res_logits[0])), 5), 1)
    best = int(np.argmax(full.scores))
    ours_mask = seg.predict(handle, POINT, [1], size=shown).masks[best]
    res["shown mask vs full mask shrunk: agreement"] = round(float((ours_mask == shrink(full.masks[best], display)).mean()), 5)
    report("sam_big_photo", res)


if __name__ == "__main__":
    main()
