"""The Segment tab: clicks and boxes on an image → SAM masks. Wiring only: prompting is
`pipeline.segment_session.SegmentSession`, drawing `app.segment_render`. Each browser session keeps
its own `SegmentSession` (and so its own statistics) in `gr.State`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import threading
from collections.abc import Callable, Iterator

import gradio as gr
import numpy as np
import torch
from gradio.data_classes import FileData

from app.downloads import download_on_click, write_download
from app.errors import shown_to_user
from app.tool_loading import loading_updates
from app.segment_render import (mask_png, png_bytes, render_candidates, render_everything, render_session, status_line,
                                thumbnail)
from pipeline.errors import UserError
from pipeline.images import fit_for_display, load_image, masked_crop, to_device
from pipeline.segment import SegmentStats
from pipeline.segment_session import SegmentSession
from pipeline.tools import ToolHost

POSITIVE, NEGATIVE = "Object (+)", "Background (−)"
POINTS, BOX = "Points", "Box (two clicks: opposite corners)"


@dataclasses.dataclass
class TabState:
    session: SegmentSession
    display: np.ndarray = dataclasses.field(repr=False)  # the image at browser size, drawn on every click
    scale: float  # displayed pixels per original pixel
    small: np.ndarray = dataclasses.field(repr=False)  # the candidates' thumbnail copy


class DeviceCopies:
    """Display copies kept where SAM runs, for the most recently clicked images, so a click copies
    nothing in. Bounded: a thousand open sessions must not hold 5.8 MB of GPU memory each; an image
    not held is uploaded again on its next click (~0.5 ms). Keyed by the image's content key (the
    copies are only read), so two users on one photo share one."""

    def __init__(self, limit: int = 8):
        self.limit = limit
        self._copies: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, t: TabState, device: torch.device) -> torch.Tensor:
        key = (t.session.handle.key, t.display.shape, str(device))
        with self._lock:
            if key not in self._copies:
                self._copies[key] = to_device(t.display, device)
                while len(self._copies) > self.limit:
                    self._copies.popitem(last=False)
            self._copies.move_to_end(key)
            return self._copies[key]


DISPLAY_COPIES = DeviceCopies()


def _write_png(data: bytes) -> str:
    return write_download(data, "mask-", ".png")


def _empty():
    return None, None, [], gr.Button(interactive=False), ""


def _render(t: TabState):
    """(display image, state, gallery, download button, status) for the session's current state. The
    full-size mask PNG is made only when the user downloads (a 12 MP one costs ~0.15 s, not per click)."""
    s = t.session
    device = s.pipeline.engine.device
    return (render_session(s, DISPLAY_COPIES.get(t, device), t.scale, device), t, render_candidates(s, t.small),
            gr.Button(interactive=s.prediction is not None), status_line(s))


@dataclasses.dataclass
class SelectionQuestion:
    """"Ask about this": the question box and button; `selection(state, question)` gives the selected
    object's image file (a masked crop, background dimmed) and the question, for image chat."""

    button: gr.Button
    question: gr.Textbox
    state: gr.State
    selection: Callable


def build_segment_tab(tools: ToolHost, examples: list[str]) -> SelectionQuestion:
    @contextlib.contextmanager
    def session_of(t: TabState | None, missing: str) -> Iterator[SegmentSession]:
        """The user's session on the loaded SAM (loaded again, and the image re-encoded, if the memory
        budget unloaded it since), held busy while the block runs."""
        if t is None:
            raise UserError(missing)
        with tools.using("segment") as seg:
            if t.session.pipeline is not seg:
                t.session.rebind(seg)
            yield t.session

    @shown_to_user
    def _step(t: TabState | None, missing: str, action: Callable[[SegmentSession], None]) -> tuple:
        """Run `action(session)` on the user's session and render it."""
        with session_of(t, missing) as session:
            action(session)
            return _render(t)

    @shown_to_user
    def on_image(path: str | None):
        if not path:
            yield _empty()
            return
        image = load_image(path)
        yield from loading_updates(tools, "segment", 5)
        with tools.using("segment") as seg:
            display, scale = fit_for_display(image, device=seg.engine.device)
            yield _render(TabState(SegmentSession(seg, image, display.shape[:2]), display, scale, thumbnail(display)))

    def on_click(t: TabState | None, label: str, mode: str, multimask: bool, evt: gr.SelectData):
        def click(s: SegmentSession) -> None:
            x, y = (v / t.scale for v in evt.index)
            if mode == BOX:
                s.box_corner(x, y, multimask)
            else:
                s.click(x, y, label == POSITIVE, multimask)

        return _step(t, "upload or choose an image first, then click on it", click)

    def on_undo(t: TabState | None, multimask: bool):
        return _step(t, "nothing to undo: no image yet", lambda s: s.undo(multimask))

    def on_clear(t: TabState | None):
        if t is None:
            return _empty()
        return _step(t, "", lambda s: s.clear())

    def on_choose(t: TabState | None, evt: gr.SelectData):
        return _step(t, "no candidates yet: click on the image first", lambda s: s.choose(evt.index))

    @shown_to_user
    def on_everything(t: TabState | None):
        with session_of(t, "upload or choose an image first") as session:
            masks = session.everything()
            n, demo = session.pipeline.everything_grid, session.pipeline.is_demo
        found = (f"{len(masks)} masks found from a {n}×{n} grid of points" if masks else
                 "no confident, stable masks found" + (" (the demo SAM has random weights)" if demo else ""))
        return (render_everything(t.display, masks),
                f"Segment everything: {found}. Click the image to go back to prompting.")

    state = gr.State(None, time_to_live=3600)  # a session idle for an hour lets go of its photo and embeddings
    with gr.Row():
        with gr.Column(scale=3):
            # Each click sends the drawn copy to the browser: a 1600×1200 photo encodes in ~10 ms as JPEG
            # and ~0.5 s as PNG (bench/sam_big_photo.py); the mask itself downloads as a lossless PNG.
            canvas = gr.Image(label="Image — upload, then click on an object", type="filepath", image_mode=None,
                              sources=["upload", "clipboard"], format="jpeg", height=560,
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
            download = gr.Button("Download chosen mask (PNG)", interactive=False)
            with gr.Row():
                question = gr.Textbox(placeholder="What is this? (about the selected object)", show_label=False,
                                      scale=4, elem_id="segment-question")
                ask = gr.Button("Ask about this", scale=1)
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

    @shown_to_user
    def on_download(t: TabState | None) -> str:
        missing = "click on an object first: there is no mask to download yet"
        with session_of(t, missing) as session:
            if session.mask is None:
                raise UserError(missing)
            return _write_png(mask_png(session.full_mask()))

    download_on_click(download, on_download, state, "segment-mask-file")

    @shown_to_user
    def selection(t: TabState | None, text: str) -> tuple[str, str]:
        missing = "click on an object first: there is nothing selected to ask about"
        with session_of(t, missing) as session:
            if session.mask is None:
                raise UserError(missing)
            crop = masked_crop(session.handle.image, session.full_mask())
        return write_download(png_bytes(crop), "selection-", ".png"), (text or "").strip() or "What is this?"

    @shown_to_user
    def segment(image: FileData, points: str = "[]", box: str = "", multimask: bool = True) -> tuple[FileData, str]:
        """API: masks for `points` (JSON [[x, y, label], …], label 1 object / 0 background) and/or `box`
        (JSON [x0, y0, x1, y1]) on `image`. Returns the best mask as a PNG of the image's size, and
        JSON with all scores and what this call cost: whether the image's embedding came from the
        cache, encoder and decoder milliseconds."""
        stats = SegmentStats()
        try:
            pts = json.loads(points or "[]")
            box_value = json.loads(box) if box else None
        except json.JSONDecodeError as e:
            raise UserError(f"points/box are not valid JSON: {e}") from None
        if not isinstance(pts, list) or any(not isinstance(p, list) or len(p) != 3 for p in pts):
            raise UserError("points must be JSON like [[x, y, 1], [x, y, 0]]")
        if image is None:
            raise UserError("send an image first, then points or a box on it")
        pixels = load_image(image["path"] if isinstance(image, dict) else image.path)
        with tools.using("segment") as seg:
            handle = seg.set_image(pixels, stats)
            result = seg.predict(handle, [p[:2] for p in pts], [p[2] for p in pts], box_value, None, multimask, stats)
        best = int(np.argmax(result.scores))
        info = {"scores": result.scores.tolist(), "best": best, "cached": stats.encoder_runs == 0,
                "encoder_ms": stats.last_encoder_ms, "decoder_ms": stats.last_decoder_ms}
        return FileData(path=_write_png(mask_png(result.masks[best]))), json.dumps(info)

    gr.api(segment, api_name="segment")
    return SelectionQuestion(ask, question, state, selection)
