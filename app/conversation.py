"""What the Chat and Image-chat tabs share: who is asking, one streamed turn, Stop.

Request rules (checks, routing, limits, Stop) are the service's (`pipeline.service`); this module
only turns its updates into Gradio's outputs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import gradio as gr

from app.sources_view import sources_markdown
from pipeline.llm.engine.seam import FinishReason
from pipeline.service.messages import text_of
from pipeline.service.requests import Update
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool

UPDATE_EVERY_S = 0.05  # the most often a streamed reply updates the page
NO_CONVERSATION = -1  # `current` when none is open (the browser keeps no falsy value); ids start at 1
CONTINUABLE = (FinishReason.LENGTH, FinishReason.CANCELLED)  # how a reply ended that Continue takes on


class Viewing:
    """Which conversation each page shows in a tab, and which conversations a reply is streaming into: a
    reply updates its page only while its conversation is the one shown there (the user may open another
    meanwhile; the reply goes on and is kept), and the list marks those still streaming."""

    def __init__(self):
        self._shown: dict[str, int] = {}
        self.streaming: set[int] = set()
        self._lock = threading.Lock()

    def show(self, page: str, conversation: int) -> None:
        with self._lock:
            self._shown[page] = conversation

    def shows(self, page: str, conversation: int) -> bool:
        return self._shown.get(page, NO_CONVERSATION) == conversation

    def started(self, page: str, conversation: int) -> None:
        """A reply's conversation got its id (a new one, just stored): the page shows it unless it moved on."""
        with self._lock:
            if self._shown.get(page, NO_CONVERSATION) == NO_CONVERSATION:
                self._shown[page] = conversation
            self.streaming.add(conversation)


def client_of(request: gr.Request | None) -> str:
    """The service's client for a browser session (or a `gradio_client`)."""
    return f"ui:{request.session_hash if request is not None else ''}"


def user_of(request: gr.Request | None) -> str:
    """Whose conversations these are: the signed-in user with `--auth`, else the one local user."""
    return (request.username if request is not None else None) or "local"


def streamed(updates: Iterator[Update], conversation: int, clear: bool = True, ended: list[str] | None = None,
             viewing: tuple[Viewing, str] | None = None,
             on_page: list[dict] | None = None) -> Iterator[tuple[object, list[dict], str, int]]:
    """The service's `updates` of a reply (`StudioService.send`) as (the textbox, the conversation with
    the growing answer, status, the id of the conversation it is kept in). The textbox is emptied once,
    with the first update (the message was accepted: a refused one stays in the box), where `clear`, and
    left alone after that: what the user types while the reply streams stays theirs. A reply that continues
    the last one (its conversation ends with the assistant's words) grows that message. `ended` gets the
    reply's finish reason. `viewing` (the tab's `Viewing`, the page): the page is updated only while it shows
    the reply's conversation; the reply goes on (and is kept) when the user opens another. `on_page`: the
    conversation as the page showed it, whose earlier replies keep what only the page shows (their sources)."""
    history = [{"role": "assistant", "content": ""}]
    notices: list[str] = []
    shown = 0.0  # when the page was last updated
    textbox: object = "" if clear else gr.skip()
    try:
        for update in updates:
            if update.messages:
                said = [dict(m) for m in update.messages if m["role"] != "system"]
                for m, before in zip(said, on_page or []):
                    if before.get("role") == m["role"] and text_of(before.get("content")).startswith(m["content"]):
                        m["content"] = text_of(before["content"])
                history = said if said and said[-1]["role"] == "assistant" else [*said, *history]
            if update.stats is not None and ended is not None:
                ended.append(str(update.stats.finish_reason))
            if update.saved is not None and update.saved.conversation is not None:
                conversation = update.saved.conversation
                if viewing is not None:
                    viewing[0].started(viewing[1], conversation)
            if update.notice:
                notices.append(update.notice)
                gr.Warning(update.notice)
            history[-1]["content"] += update.text + sources_markdown(update.sources)
            # Each update sends the whole history: at most one per UPDATE_EVERY_S, so a long
            # conversation streams as fast as a short one (the last update always goes out).
            if update.stats is None and update.notice is None and time.monotonic() - shown < UPDATE_EVERY_S:
                continue
            shown = time.monotonic()
            if viewing is None or viewing[0].shows(viewing[1], conversation):
                yield textbox, history, " · ".join(notices + [update.status]), conversation
            else:  # the page shows another conversation now: this one streams on unseen
                yield textbox, gr.skip(), gr.skip(), gr.skip()
            textbox = gr.skip()
    finally:  # ended, stopped, or its page gone: no longer marked as streaming
        if viewing is not None:
            viewing[0].streaming.discard(conversation)


def continuable(found: dict) -> bool:
    """Whether a stored conversation ends with a reply that was stopped or that a crash cut."""
    said = [m for m in found["messages"] if m["role"] != "system"]
    return bool(said) and said[-1]["role"] == "assistant" and said[-1]["state"] in ("cancelled", "interrupted")


def turn(updates: Iterator[Update], conversation: int, viewing: tuple[Viewing, str], clear: bool = True,
         during: tuple = (), on_page: list[dict] | None = None) -> Iterator[tuple]:
    """`streamed`'s outputs, then `during` (the tab's own outputs' values while a reply streams), then the
    tab's Continue button: hidden while the reply streams, offered after one cut at the token limit or
    stopped, to go on in the same message; `on_page` as in `streamed`."""
    ended: list[str] = []
    unchanged: tuple = ()  # the outputs before Continue, left as they are
    for shown_now in streamed(updates, conversation, clear, ended, viewing, on_page):
        unchanged = (gr.skip(),) * (len(shown_now) + len(during))
        yield *shown_now, *during, gr.Button(visible=False)
    if ended and ended[-1] in CONTINUABLE:
        yield *unchanged, gr.Button(visible=True)


def wire_stop(stop: gr.Button, service: StudioService, tool: Tool, api_name: str) -> None:
    """Stop ends this session's replies of `tool`: the engine drops them at its next step, and each
    reply's last update (the text so far, "Stopped: …" and its statistics) still reaches the page."""
    def stop_replies(request: gr.Request) -> None:
        service.stop(client_of(request), tool)

    stop.click(stop_replies, None, None, api_name=api_name)
