"""The Segment tab: clicks and boxes on an image → SAM masks. Wiring only; the work is in
`pipeline.segment`. Each browser session keeps its own image, prompts and masks in `gr.State`."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import gradio as gr
import numpy as np
from PIL import Image
from gradio.data_classes import FileData
from gradio.utils import get_upload_folder

from pipeline.errors import UserError
from pipeline.images import fit_for_display, load_image
from pipeline.segment import (ImageHandle, Prediction, SegmentPipeline, mask_png, render_everything,
                              render_overlay)

POSITIVE, NEGATIVE = "Object (+)", "Background (−)"
POINTS, BOX = "Points", "Box (two clicks: opposite corners)"


@dataclasses.dataclass
class Session:
    handle: ImageHandle
    display: np.ndarray = dataclasses.field(repr=False)  # the image at browser size, drawn on every click
    scale: float  # displayed pixels per original pixel
    points: list[list[float]] = dataclasses.field(default_factory=list)
    labels: list[int] = dataclasses.field(default_factory=list)
    box: list[float] | None = None
    corner: list[float] | None = None  # first corner of a box being drawn
    history: list[str] = dataclasses.field(default_factory=list)  # "point" | "box", for Undo
    prediction: Prediction | None = None
    chosen: int = 0


def shrink(mask: np.ndarray | None, like: np.ndarray) -> np.ndarray | None:
    """A full-size mask at the display copy's size (nearest neighbour keeps it binary)."""
    if mask is None or mask.shape == like.shape[:2]:
        return mask
    return np.asarray(Image.fromarray(mask).resize((like.shape[1], like.shape[0]), Image.NEAREST))


def _write_png(data: bytes) -> str:
    """Into Gradio's own upload folder: the one place it serves files from without extra settings."""
    folder = Path(get_upload_folder()) / "masks"
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(prefix="mask-", suffix=".png", delete=False, dir=folder) as f:
        f.write(data)
    return f.name


def build_segment_tab(seg: SegmentPipeline, examples: list[str]) -> None:
    def view(s: Session):
        """(display image, gallery, download, status) for the session's current state. Drawing
        happens at browser size, so a click on a 40-MP photo costs no more than on a small one."""
        p = s.prediction
        mask = p.masks[s.chosen] if p is not None else None
        shown = [[v * s.scale for v in point] for point in s.points + ([s.corner] if s.corner else [])]
        labels = s.labels + ([1] if s.corner else [])
        box = [v * s.scale for v in s.box] if s.box else None
        display = render_overlay(s.display, shrink(mask, s.display), shown, labels, box)
        gallery = [] if p is None else [(fit_for_display(render_overlay(s.display, shrink(m, s.display)), 256)[0],
                                         f"{'✓ ' if i == s.chosen else ''}#{i + 1} · IoU {score:.2f}")
                                        for i, (m, score) in enumerate(zip(p.masks, p.scores))]
        download = gr.DownloadButton(value=_write_png(mask_png(mask)) if mask is not None else None,
                                     interactive=mask is not None)
        st = seg.stats
        n = len(s.points)
        status = (f"{n} point{'' if n == 1 else 's'}{' + box' if s.box else ''} · encoder runs {st.encoder_runs} "
                  f"(last {st.last_encoder_ms:.0f} ms), cached embeddings reused {st.cache_hits}× · "
                  f"decoder {st.last_decoder_ms:.1f} ms")
        return display, gallery, download, status

    def render(s: Session):
        display, gallery, download, status = view(s)
        return display, s, gallery, download, status

    def predict(s: Session, multimask: bool) -> Session:
        if not s.points and s.box is None:
            s.prediction = None
            return s
        previous = s.prediction.low_res_logits[s.chosen] if s.prediction is not None else None
        s.prediction = seg.predict(s.handle, s.points, s.labels, s.box, previous, multimask)
        s.chosen = int(np.argmax(s.prediction.scores))
        return s

    def on_image(path: str | None):
        if not path:
            return None, None, [], gr.DownloadButton(value=None, interactive=False), ""
        try:
            image = load_image(path)
            s = Session(seg.set_image(image), *fit_for_display(image))
        except UserError as e:
            raise gr.Error(str(e)) from None
        return render(s)

    def on_click(s: Session | None, label: str, mode: str, multimask: bool, evt: gr.SelectData):
        if s is None:
            raise gr.Error("upload or choose an image first, then click on it")
        x, y = (v / s.scale for v in evt.index)
        try:
            if mode == BOX:
                if s.corner is None:
                    s.corner = [x, y]
                else:
                    (x0, y0), (x1, y1) = s.corner, (x, y)
                    s.box, s.corner = [min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)], None
                    s.history.append("box")
                    s = predict(s, multimask)
            else:
                s.points.append([x, y])
                s.labels.append(1 if label == POSITIVE else 0)
                s.history.append("point")
                s = predict(s, multimask)
        except UserError as e:
            raise gr.Error(str(e)) from None
        return render(s)

    def on_undo(s: Session | None, multimask: bool):
        if s is None:
            raise gr.Error("nothing to undo: no image yet")
        if s.corner is not None:
            s.corner = None
        elif s.history:
            if s.history.pop() == "box":
                s.box = None
            else:
                s.points.pop()
                s.labels.pop()
            s.prediction = None  # refinement restarts from the remaining prompts
            s = predict(s, multimask)
        return render(s)

    def on_clear(s: Session | None):
        if s is None:
            return None, None, [], gr.DownloadButton(value=None, interactive=False), ""
        s = Session(s.handle, s.display, s.scale)
        return render(s)

    def on_everything(s: Session | None):
        if s is None:
            raise gr.Error("upload or choose an image first")
        masks = seg.segment_everything(s.handle)
        display = render_everything(s.display, [dataclasses.replace(m, mask=shrink(m.mask, s.display)) for m in masks])
        n = seg.everything_grid
        found = (f"{len(masks)} masks found from a {n}×{n} grid of points" if masks else
                 "no confident, stable masks found" + (" (the demo SAM has random weights)" if seg.is_demo else ""))
        return display, f"Segment everything: {found}. Click the image to go back to prompting."

    def on_choose(s: Session | None, evt: gr.SelectData):
        if s is None or s.prediction is None:
            raise gr.Error("no candidates yet: click on the image first")
        s.chosen = evt.index
        return render(s)

    state = gr.State(None)
    with gr.Row():
        with gr.Column(scale=3):
            canvas = gr.Image(label="Image — upload, then click on an object", type="filepath", image_mode=None,
                              sources=["upload", "clipboard"], format="png", height=560,
                              elem_id="segment-canvas")
        with gr.Column(scale=2):
            label = gr.Radio([POSITIVE, NEGATIVE], value=POSITIVE, label="A click marks")
            mode = gr.Radio([POINTS, BOX], value=POINTS, label="Prompt")
            multimask = gr.Checkbox(True, label="Three candidate masks (pick one below)")
            with gr.Row():
                undo = gr.Button("Undo")
                clear = gr.Button("Clear prompts")
                everything = gr.Button("Segment everything")
            gallery = gr.Gallery(label="Candidates", columns=3, height=220, allow_preview=False,
                                 elem_id="segment-candidates")
            download = gr.DownloadButton("Download chosen mask (PNG)", interactive=False)
            status = gr.Markdown("", elem_id="segment-status")
    outputs = [canvas, state, gallery, download, status]
    gr.Examples(examples, inputs=canvas, outputs=outputs, fn=on_image, run_on_click=True, cache_examples=False)
    canvas.upload(on_image, canvas, outputs, api_visibility="private")
    canvas.clear(on_image, canvas, outputs, api_visibility="private")
    canvas.select(on_click, [state, label, mode, multimask], outputs, api_visibility="private")
    undo.click(on_undo, [state, multimask], outputs, api_visibility="private")
    clear.click(on_clear, state, outputs, api_visibility="private")
    gallery.select(on_choose, state, outputs, api_visibility="private")
    everything.click(on_everything, state, [canvas, status], api_visibility="private")

    def segment(image: FileData, points: str = "[]", box: str = "", multimask: bool = True) -> tuple[FileData, str]:
        """API: masks for `points` (JSON [[x, y, label], …], label 1 object / 0 background) and/or `box`
        (JSON [x0, y0, x1, y1]) on `image`. Returns the best mask as a PNG of the image's size, and
        JSON with all scores and the pipeline's counters (encoder runs, cache hits, timings)."""
        try:
            pts = json.loads(points or "[]")
            box_value = json.loads(box) if box else None
            if not isinstance(pts, list) or any(not isinstance(p, list) or len(p) != 3 for p in pts):
                raise UserError("points must be JSON like [[x, y, 1], [x, y, 0]]")
            if image is None:
                raise UserError("send an image first, then points or a box on it")
            handle = seg.set_image(load_image(image["path"] if isinstance(image, dict) else image.path))
            result = seg.predict(handle, [p[:2] for p in pts], [p[2] for p in pts], box_value, None, multimask)
        except json.JSONDecodeError as e:
            raise gr.Error(f"points/box are not valid JSON: {e}") from None
        except UserError as e:
            raise gr.Error(str(e)) from None
        best = int(np.argmax(result.scores))
        info = {"scores": result.scores.tolist(), "best": best, "stats": dataclasses.asdict(seg.stats)}
        return FileData(path=_write_png(mask_png(result.masks[best]))), json.dumps(info)

    gr.api(segment, api_name="segment")
