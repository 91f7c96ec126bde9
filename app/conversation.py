"""What the Chat and Image-chat tabs share: sampling controls, one streamed turn, Stop.

Request rules (checks, routing, limits, Stop) are the service's (`pipeline.service`); this module
only turns its updates into Gradio's outputs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import gradio as gr

from app.errors import shown_to_user
from pipeline.llm.sampling import LIMITS, SamplingParams
from pipeline.service.studio import ChatTurn, Saved, StudioService

UPDATE_EVERY_S = 0.05  # the most often a streamed reply updates the page
SLIDERS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens", "seed")  # controls' order
UI_MAX = {"max_new_tokens": 4096}  # a slider's usable span; typing a larger value in its box still works


def client_of(request: gr.Request | None) -> str:
    """The service's client for a browser session (or a `gradio_client`)."""
    return f"ui:{request.session_hash if request is not None else ''}"


def sampling_controls(tab: str, max_new_tokens: int = 512) -> list:
    """The `SLIDERS` controls, spanning `pipeline.llm.sampling.LIMITS`, starting at `SamplingParams`'
    defaults; element ids start with `tab` so each tab's controls can be found."""
    defaults = dataclasses.replace(SamplingParams(), max_new_tokens=max_new_tokens)
    labels = {"temperature": "Temperature (0 = greedy)", "top_p": "Top-p", "top_k": "Top-k (0 = off)",
              "repetition_penalty": "Repetition penalty", "max_new_tokens": "Max new tokens"}
    steps = {"temperature": 0.05, "top_p": 0.05, "top_k": 1, "repetition_penalty": 0.01, "max_new_tokens": 1}
    with gr.Accordion("Sampling", open=True):
        sliders = [gr.Slider(LIMITS[name].low + (steps[name] if LIMITS[name].low_open else 0),
                             UI_MAX.get(name, LIMITS[name].high), value=getattr(defaults, name), step=steps[name],
                             label=labels[name], elem_id=f"{tab}-{name.replace('_', '-')}") for name in SLIDERS[:-1]]
        return sliders + [gr.Number(-1, precision=0, label="Seed (-1 = random)", elem_id=f"{tab}-seed")]


def user_of(request: gr.Request | None) -> str:
    """Whose conversations these are: the signed-in user with `--auth`, else the one local user."""
    return (request.username if request is not None else None) or "local"


@shown_to_user
def stream_turn(service: StudioService, turn: ChatTurn, request: gr.Request,
                saved: Saved | None = None) -> Iterator[tuple[str, list[dict], str]]:
    """The service's reply to `turn` as (cleared textbox, history with the growing answer, status);
    kept in the `saved` conversation as it happens."""
    history = [m for m in turn.messages if m["role"] != "system"] + [{"role": "assistant", "content": ""}]
    notices: list[str] = []
    shown = 0.0  # when the page was last updated
    for update in service.reply(client_of(request), turn, saved=saved):
        if update.notice:
            notices.append(update.notice)
            gr.Warning(update.notice)
        history[-1]["content"] += update.text
        # Each update sends the whole history: at most one per UPDATE_EVERY_S, so a long
        # conversation streams as fast as a short one (the last update always goes out).
        if update.stats is None and update.notice is None and time.monotonic() - shown < UPDATE_EVERY_S:
            continue
        shown = time.monotonic()
        yield "", history, " · ".join(notices + [update.status])


def wire_stop(stop: gr.Button, service: StudioService, tool: str, api_name: str):
    """Stop ends this session's replies of `tool`: the engine drops them at its next step, and each
    reply's last update (the text so far, "Stopped: …" and its statistics) still reaches the page."""
    def stop_replies(request: gr.Request) -> None:
        service.stop(client_of(request), tool)

    return stop.click(stop_replies, None, None, api_name=api_name)
