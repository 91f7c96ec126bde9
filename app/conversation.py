"""What the Chat and Image-chat tabs share: sampling controls, one streamed turn, per-session Stop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import gradio as gr

from app.errors import shown_to_user
from pipeline.errors import UserError
from pipeline.llm.language_model import ChatEvent
from pipeline.llm.sampling import SamplingParams

STOPPED = "Stopped: the reply so far is kept."


def text_of(content) -> str:
    """Gradio 6 hands message content over as a list of parts; keep the text ones."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in parts)


class CancelFlags:
    """One cancel flag per browser session, so Stop ends only that session's reply."""

    def __init__(self):
        self._flags: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def fresh(self, session: str) -> threading.Event:
        with self._lock:
            self._flags[session] = threading.Event()
            return self._flags[session]

    def cancel(self, session: str) -> None:
        with self._lock:
            flag = self._flags.get(session)
        if flag is not None:
            flag.set()


def sampling_controls(tab: str, max_new_tokens: int = 512) -> list:
    """Temperature, top-p, top-k, repetition penalty, max new tokens, seed (in `SamplingParams` order);
    element ids start with `tab` so each tab's controls can be found."""
    with gr.Accordion("Sampling", open=True):
        return [
            gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature (0 = greedy)", elem_id=f"{tab}-temperature"),
            gr.Slider(0.05, 1, value=0.8, step=0.05, label="Top-p", elem_id=f"{tab}-top-p"),
            gr.Slider(0, 200, value=20, step=1, label="Top-k (0 = off)", elem_id=f"{tab}-top-k"),
            gr.Slider(1.0, 2.0, value=1.05, step=0.01, label="Repetition penalty", elem_id=f"{tab}-repetition"),
            gr.Slider(1, 4096, value=max_new_tokens, step=1, label="Max new tokens", elem_id=f"{tab}-max-new-tokens"),
            gr.Number(-1, precision=0, label="Seed (-1 = random)", elem_id=f"{tab}-seed"),
        ]


@shown_to_user
def start_turn(message, history, sampling) -> tuple[SamplingParams, list[dict]]:
    """Validated parameters and the history as plain {role, content} dicts."""
    temperature, top_p, top_k, repetition_penalty, max_new_tokens, seed = sampling
    try:
        params = SamplingParams(max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                                top_p=float(top_p), top_k=int(top_k), repetition_penalty=float(repetition_penalty),
                                seed=None if seed is None or int(seed) < 0 else int(seed)).validated()
    except (TypeError, ValueError) as e:
        raise UserError(f"unusable sampling settings: {e}") from None
    if not isinstance(message, str) or not message.strip():
        raise UserError("the message is empty: type something to send")
    return params, [{"role": m["role"], "content": text_of(m["content"])} for m in history or []]


def stats_line(stats) -> str:
    reused = f" ({stats.cached_tokens} reused from the last turn)" if stats.cached_tokens else ""
    line = (f"{stats.new_tokens} tokens · {stats.tokens_per_s:.1f} tok/s · first token "
            f"{stats.time_to_first_token_s * 1000:.0f} ms · prompt {stats.prompt_tokens} tokens{reused} · "
            f"ended: {stats.finish_reason}")
    return f"{STOPPED} {line}" if stats.finish_reason == "cancelled" else line


@shown_to_user
def stream_turn(reply: Callable[[threading.Event, str], Iterator[ChatEvent]], history: list[dict], message: str,
                flags: CancelFlags, request: gr.Request, tool: str) -> Iterator[tuple[str, list[dict], str]]:
    """Run one reply, yielding (cleared textbox, history with the growing answer, status line).
    `reply(cancel, session)` gets the session's Stop flag and the session name the engine keys
    its cached turns by (one per browser session and tool)."""
    history = history + [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
    notices: list[str] = []
    session = request.session_hash or ""
    for event in reply(flags.fresh(session), f"{tool}:{session}"):
        if event.notice:
            notices.append(event.notice)
            gr.Warning(event.notice)
        history[-1]["content"] += event.text
        status = stats_line(event.stats) if event.stats else "generating…"
        yield "", history, " · ".join(notices + [status])


def wire_stop(stop: gr.Button, flags: CancelFlags, status: gr.Markdown, api_name: str):
    """Stop sets the session's flag: the engine drops the reply at its next step and the reply's
    last update (the text so far, "ended: cancelled") still reaches the page."""
    def stop_reply(request: gr.Request) -> str:
        flags.cancel(request.session_hash or "")
        return STOPPED

    return stop.click(stop_reply, None, status, api_name=api_name)
