"""The Segment tab: clicks and boxes on an image → SAM masks. Wiring only: requests go through the
studio service, prompting is `pipeline.pipelines.segment_session.SegmentSession`, drawing `app.segment_render`. Each browser session keeps
its own `SegmentSession` (and so its own statistics) in `gr.State`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator

import gradio as gr
import numpy as np
from gradio.data_classes import FileData

from app.downloads import download_on_click, write_download
from app.errors import raised_to_client, shown_to_user
from app.segment_render import (mask_png, png_bytes, render_candidates, render_everything, render_session, status_line,
                                thumbnail)
from pipeline.errors import UserError
from pipeline.images import fit_for_display, load_image, masked_crop
from pipeline.pipelines.segment_session import SegmentSession
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool

POSITIVE, NEGATIVE = "Object (+)", "Background (−)"
POINTS, BOX = "Points", "Box (two clicks: opposite corners)"


@dataclasses.dataclass
class TabState:
    session: SegmentSession
    display: np.ndarray = dataclasses.field(repr=False)  # the image at browser size, drawn on every click
    scale: float  # displayed pixels per original pixel
    small: np.ndarray = dataclasses.field(repr=False)  # the candidates' thumbnail copy
    verbose: bool = False  # the status line in the engine's terms too


def _write_png(data: bytes) -> str:
    return write_download(data, "mask-", ".png")


def _empty():
    return None, None, [], gr.Button(interactive=False), ""


def _render(t: TabState):
    """(display image, state, gallery, download button, status) for the session's current state. The
    full-size mask PNG is made only when the user downloads (a 12 MP one costs ~0.15 s, not per click)."""
    s = t.session
    return (render_session(s, s.display_copy(t.display), t.scale, s.device), t, render_candidates(s, t.small),
            gr.Button(interactive=s.mask is not None and bool(s.mask.any())), status_line(s, t.verbose))


@dataclasses.dataclass
class SelectionQuestion:
    """"Ask about this": the question box and button; `selection(state, question)` gives the selected
    object's image file (a masked crop, background dimmed) and the question, for image chat."""

    button: gr.Button
    question: gr.Textbox
    state: gr.State
    selection: Callable


def build_segment_tab(service: StudioService, examples: list[str]) -> SelectionQuestion:
    @contextlib.contextmanager
    def session_of(t: TabState | None, missing: str) -> Iterator[SegmentSession]:
        if t is None:
            raise UserError(missing)
        with service.segmenting(t.session) as session:
            yield session

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
        for line in service.loading(Tool.SEGMENT):
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), line
        session = service.segment_session(image)
        display, scale = fit_for_display(image, device=session.device)  # resized where SAM runs
        session.shown = display.shape[:2]  # masks come at the size the browser shows
        yield _render(TabState(session, display, scale, thumbnail(display), service.verbose))

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
        return (render_everything(t.display, masks), [], gr.Button(interactive=False),  # no stale candidates
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
            gallery = gr.Gallery(label="Candidates", columns=3, height=220, allow_preview=False, buttons=[],
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
    everything.click(on_everything, state, [canvas, gallery, download, status], api_visibility="private")

    def on_download(t: TabState | None) -> str:
        missing = "click on an object first: there is no mask to download yet"
        with session_of(t, missing) as session:
            if session.mask is None:
                raise UserError(missing)
            if not session.mask.any():
                raise UserError("the chosen mask is empty: click on the object again, or pick another candidate")
            return _write_png(mask_png(session.full_mask()))

    download_on_click(download, on_download, state, "segment-mask-file")

    def selection(t: TabState | None, text: str) -> tuple[str, str]:
        missing = "click on an object first: there is nothing selected to ask about"
        with session_of(t, missing) as session:
            if session.mask is None:
                raise UserError(missing)
            crop = masked_crop(session.handle.image, session.full_mask())
        return write_download(png_bytes(crop), "selection-", ".png"), (text or "").strip() or "What is this?"

    @raised_to_client
    def segment(image: FileData, points: str = "[]", box: str = "", multimask: bool = True) -> tuple[FileData, str]:
        """API: masks for `points` (JSON [[x, y, label], …], label 1 object / 0 background) and/or `box`
        (JSON [x0, y0, x1, y1]) on `image`. Returns the best mask as a PNG of the image's size, and
        JSON with all scores and what this call cost: whether the image's embedding came from the
        cache, encoder and decoder milliseconds."""
        try:
            pts = json.loads(points or "[]")
            box_value = json.loads(box) if box else None
        except json.JSONDecodeError as e:
            raise UserError(f"points/box are not valid JSON: {e}") from None
        if image is None:
            raise UserError("send an image first, then points or a box on it")
        session = service.segment(image["path"] if isinstance(image, dict) else image.path, pts, box_value, multimask)
        info = {"scores": session.prediction.scores.tolist(), "best": session.chosen,
                "cached": session.stats.encoder_runs == 0, "encoder_ms": session.stats.last_encoder_ms,
                "decoder_ms": session.stats.last_decoder_ms}
        return FileData(path=_write_png(mask_png(session.mask))), json.dumps(info)

    gr.api(segment, api_name="segment")
    return SelectionQuestion(ask, question, state, selection)
