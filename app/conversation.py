"""What the Chat and Image-chat tabs share: sampling controls, one streamed turn, per-session Stop."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

from app.errors import shown_to_user
from app.tool_loading import loading_updates
from pipeline.errors import UserError
from pipeline.llm.language_model import ChatEvent
from pipeline.llm.sampling import LIMITS, SamplingParams
from pipeline.tools import ToolHost

STOPPED = "Stopped: the reply so far is kept."


def text_of(content) -> str:
    """Gradio 6 hands message content over as a list of parts; keep the text ones."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in parts)


UPDATE_EVERY_S = 0.05  # the most often a streamed reply updates the page
MAX_IN_FLIGHT = 2  # replies one browser session (or API client session) may have running or queued


class CancelFlags:
    """Each session's replies in flight, with their Stop flags: Stop ends every reply of that session
    only, including one still waiting for its tool to load or for a place in the batch, and a session
    cannot queue more than MAX_IN_FLIGHT replies (one client queueing 200 chats would starve the rest)."""

    def __init__(self):
        self._flags: dict[str, list[threading.Event]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self, session: str) -> Iterator[threading.Event]:
        flag = threading.Event()
        with self._lock:
            flags = self._flags.setdefault(session, [])
            if len(flags) >= MAX_IN_FLIGHT:
                raise UserError(f"this session already has {len(flags)} replies in progress: wait for them, "
                                f"or press Stop")
            flags.append(flag)
        try:
            yield flag
        finally:
            with self._lock:
                flags.remove(flag)
                if not flags:
                    del self._flags[session]

    def cancel(self, session: str) -> None:
        with self._lock:
            for flag in self._flags.get(session, []):
                flag.set()


SLIDERS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens", "seed")  # controls' order
UI_MAX = {"max_new_tokens": 4096}  # a slider's usable span; typing a larger value in its box still works


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


def plain_history(history) -> list[dict]:
    """The history as {role, content: text} messages, whether content is text (API clients) or a list of
    parts (Gradio's Chatbot); anything else is a `UserError` saying what was expected."""
    if history is None:
        return []
    if not isinstance(history, list):
        raise UserError(f"history must be a list of {{role, content}} messages, got {type(history).__name__}")
    out = []
    for i, m in enumerate(history):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise UserError(f"history[{i}] must be {{'role': 'user' or 'assistant', 'content': text}}, got {m!r:.80}")
        out.append({"role": m["role"], "content": text_of(m.get("content", ""))})
    return out


@shown_to_user
def start_turn(message, history, sampling) -> tuple[SamplingParams, list[dict]]:
    """Validated parameters (a seed below 0 is the UI's "random") and the history as plain dicts."""
    values = dict(zip(SLIDERS, sampling))
    if isinstance(values.get("seed"), (int, float)) and values["seed"] < 0:
        values["seed"] = None
    params = SamplingParams.from_values(**values)
    if not isinstance(message, str) or not message.strip():
        raise UserError("the message is empty: type something to send")
    return params, plain_history(history)


def stats_line(stats, context: int = 0) -> str:
    """The reply's statistics line, marked when the user stopped it."""
    line = stats.summary(context)
    return f"{STOPPED} {line}" if stats.finish_reason == "cancelled" else line


@shown_to_user
def stream_turn(tools: ToolHost, name: str, reply: Callable[[Any, threading.Event, str], Iterator[ChatEvent]],
                history: list[dict], message: str, flags: CancelFlags, request: gr.Request
                ) -> Iterator[tuple[str, list[dict], str]]:
    """Run one reply of tool `name`, yielding (cleared textbox, history with the growing answer, status
    line); first, while the tool loads, its progress. `reply(pipeline, cancel, session)` gets the
    loaded pipeline, the session's Stop flag (set from the start, so a Stop during the load or the
    queueing counts) and the session name the engine keys its cached turns by."""
    session = request.session_hash or ""
    with flags.running(session) as cancel:
        yield from loading_updates(tools, name, 3)
        history = history + [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        notices: list[str] = []
        shown = 0.0  # when the page was last updated
        with tools.using(name) as pipeline:
            for event in reply(pipeline, cancel, f"{name.replace(' ', '-')}:{session}"):
                if event.notice:
                    notices.append(event.notice)
                    gr.Warning(event.notice)
                history[-1]["content"] += event.text
                # Each update sends the whole history: at most one per UPDATE_EVERY_S, so a long
                # conversation streams as fast as a short one (the last update always goes out).
                if event.stats is None and event.notice is None and time.monotonic() - shown < UPDATE_EVERY_S:
                    continue
                shown = time.monotonic()
                status = stats_line(event.stats, pipeline.llm.context) if event.stats else "generating…"
                yield "", history, " · ".join(notices + [status])


def wire_stop(stop: gr.Button, flags: CancelFlags, status: gr.Markdown, api_name: str):
    """Stop sets the session's flag: the engine drops the reply at its next step and the reply's
    last update (the text so far, "ended: cancelled") still reaches the page."""
    def stop_reply(request: gr.Request) -> str:
        flags.cancel(request.session_hash or "")
        return STOPPED

    return stop.click(stop_reply, None, status, api_name=api_name)
