"""What the Chat and Image-chat tabs share: who is asking, one streamed turn, Stop.

Request rules (checks, routing, limits, Stop) are the service's (`pipeline.service`); this module
only turns its updates into Gradio's outputs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import gradio as gr

from app.sources_view import sources_markdown
from pipeline.llm.engine.seam import FinishReason
from pipeline.service.messages import text_of
from pipeline.service.requests import Update
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool

UPDATE_EVERY_S = 0.05  # the most often a streamed reply updates the page
HOLD_S = 5.0  # the longest a switch of conversation waits for a reply's update to be sent
NO_CONVERSATION = -1  # `current` when none is open (the browser keeps no falsy value); ids start at 1
CONTINUABLE = (FinishReason.LENGTH, FinishReason.CANCELLED)  # how a reply ended that Continue takes on


@dataclass(frozen=True)
class Shown:
    """What a page shows in a tab: a conversation (`NO_CONVERSATION`: a new one), as the page was given it."""
    conversation: int
    history: list[dict] = field(default_factory=list)
    continuable: bool = False


class Frame(NamedTuple):
    """One update of a streamed reply: the textbox, the conversation with the growing answer, the status
    and the conversation's id; the Continue button; whether the page showed the reply's conversation."""
    outputs: tuple
    more: object
    here: bool


class Viewing:
    """Which conversation each page shows in a tab, and which conversations a reply is streaming into: a
    reply updates its page only while its conversation is the one shown there (the user may open another
    meanwhile; the reply goes on and is kept), and the list marks those still streaming."""

    def __init__(self):
        self._shown: dict[str, Shown] = {}
        self._held: dict[str, threading.Lock] = {}  # per page: held from a reply's check until its update is sent
        self.streaming: set[int] = set()
        self._lock = threading.Lock()

    def _page(self, page: str) -> threading.Lock:
        with self._lock:
            return self._held.setdefault(page, threading.Lock())

    def show(self, page: str, shown: Shown) -> None:
        """The page shows `shown` from now on, once a reply's update already checked has been sent."""
        held = self._page(page).acquire(timeout=HOLD_S)  # a reply whose page is gone may hold it until collected
        try:
            self._shown[page] = shown
        finally:
            if held:
                self._page(page).release()

    @contextlib.contextmanager
    def updating(self, page: str, conversation: int) -> Iterator[Shown | None]:
        """None while the page shows `conversation`, else what it shows instead; the page kept so while the
        caller yields its update (Gradio sends a generator's output before resuming it; `show` waits)."""
        with self._page(page):
            shown = self._shown.get(page, Shown(NO_CONVERSATION))
            yield None if shown.conversation == conversation else shown

    def started(self, page: str, conversation: int) -> None:
        """A reply's conversation got its id (a new one, just stored): the page shows it unless it moved on."""
        with self._lock:
            if self._shown.get(page, Shown(NO_CONVERSATION)).conversation == NO_CONVERSATION:
                self._shown[page] = Shown(conversation)
            self.streaming.add(conversation)


def client_of(request: gr.Request | None) -> str:
    """The service's client for a browser session (or a `gradio_client`)."""
    return f"ui:{request.session_hash if request is not None else ''}"


def user_of(request: gr.Request | None) -> str:
    """Whose conversations these are: the signed-in user with `--auth`, else the one local user."""
    return (request.username if request is not None else None) or "local"


def streamed(updates: Iterator[Update], conversation: int, clear: bool = True, ended: list[str] | None = None,
             viewing: tuple[Viewing, str] | None = None, on_page: list[dict] | None = None) -> Iterator[Frame]:
    """The service's `updates` of a reply (`StudioService.send`) as `Frame`s. The textbox is emptied once,
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
    here = True  # whether the page showed the reply at its last update
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
            with viewing[0].updating(viewing[1], conversation) if viewing else contextlib.nullcontext() as away:
                if away is None:
                    yield Frame((textbox, history, " · ".join(notices + [update.status]), conversation),
                               gr.Button(visible=False), True)
                elif here:  # the page just moved on: what it shows now is put back, over an update of this reply
                    # that may reach it after the switch (Gradio applies two events' outputs in no fixed order)
                    yield Frame((gr.skip(), away.history, "", away.conversation),
                                gr.Button(visible=away.continuable), False)
                else:  # this reply streams on unseen
                    yield Frame((gr.skip(),) * 4, gr.skip(), False)
            here, textbox = away is None, gr.skip()
    finally:  # ended, stopped, or its page gone: no longer marked as streaming
        if viewing is not None:
            viewing[0].streaming.discard(conversation)


def continuable(found: dict) -> bool:
    """Whether a stored conversation ends with a reply that was stopped or that a crash cut."""
    said = [m for m in found["messages"] if m["role"] != "system"]
    return bool(said) and said[-1]["role"] == "assistant" and said[-1]["state"] in ("cancelled", "interrupted")


def turn(updates: Iterator[Update], conversation: int, viewing: tuple[Viewing, str], clear: bool = True,
         during: tuple = (), on_page: list[dict] | None = None) -> Iterator[tuple]:
    """`streamed`'s outputs, then `during` (the tab's own outputs' values while a reply streams on its
    page), then the tab's Continue button: hidden while the reply streams, offered after one cut at the
    token limit or stopped, to go on in the same message; `on_page` as in `streamed`."""
    ended: list[str] = []
    here = True
    for frame in streamed(updates, conversation, clear, ended, viewing, on_page):
        here = frame.here
        yield *frame.outputs, *(during if here else (gr.skip(),) * len(during)), frame.more
    if here and ended and ended[-1] in CONTINUABLE:
        yield *(gr.skip(),) * (4 + len(during)), gr.Button(visible=True)


def wire_stop(stop: gr.Button, service: StudioService, tool: Tool, api_name: str) -> None:
    """Stop ends this session's replies of `tool`: the engine drops them at its next step, and each
    reply's last update (the text so far, "Stopped: …" and its statistics) still reaches the page."""
    def stop_replies(request: gr.Request) -> None:
        service.stop(client_of(request), tool)

    stop.click(stop_replies, None, None, api_name=api_name)
