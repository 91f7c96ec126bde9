"""A reply streaming into a page the user moves away from (the Chat and Image-chat tabs' `turn`): the
page gets what it shows now put back once, then nothing more from that reply, and its update in flight
is sent before the switch. The browser test clicks this; these frames show it whatever the timing."""

import gradio as gr
import pytest

from app import conversation
from app.conversation import CONTINUABLE, NO_CONVERSATION, Shown, Viewing, turn
from pipeline.llm.engine.seam import GenerationStats
from pipeline.service.requests import Saved, Update

SKIP = gr.skip()
OTHER = Shown(3, [{"role": "user", "content": "An older question"}], continuable=True)


@pytest.fixture(autouse=True)
def every_update_shown(monkeypatch):
    """Every update makes a frame (the page's rate limit is a clock, which a test must not depend on)."""
    monkeypatch.setattr(conversation, "UPDATE_EVERY_S", -1.0)


def _frames(viewing: Viewing, switch_after: int | None) -> list[tuple]:
    """The reply's frames, with the answer each one showed (the history list grows in place)."""
    return [(*f, f[1][-1]["content"] if isinstance(f[1], list) and f[1] else None)
            for f in turn(_reply(viewing, switch_after), NO_CONVERSATION, (viewing, "page"))]


def _reply(viewing: Viewing, switch_after: int | None):
    """A reply into conversation 7 of four updates, cut at the token limit; with `switch_after`, the user
    opens conversation 3 on the page after that many updates (while the reply computes its next token)."""
    ends = GenerationStats(new_tokens=4, finish_reason=CONTINUABLE[0])
    for n, update in enumerate([Update(text="a", saved=Saved("local", 7), status="generating…"),
                                Update(text="b"), Update(text="c"), Update(text="d", stats=ends)]):
        if n == switch_after:
            viewing.show("page", OTHER)
        yield update


def test_a_reply_left_puts_back_once_what_the_page_shows_then_streams_on_unseen():
    viewing = Viewing()
    viewing.show("page", Shown(NO_CONVERSATION))
    frames = _frames(viewing, switch_after=2)
    assert [(f[3], f[5]) for f in frames[:2]] == [(7, "a"), (7, "ab")]  # the page's own reply
    textbox, history, status, current, more, _ = frames[2]
    assert (textbox, history, status, current) == (SKIP, OTHER.history, "", 3)  # conversation 3, as opened
    assert more.visible is True  # its own Continue button, which the reply's updates had hidden
    assert frames[3] == (*(SKIP,) * 5, None)  # nothing more from the reply: no Continue offered on the other page
    assert len(frames) == 4 and 7 not in viewing.streaming


def test_a_reply_on_its_page_ends_with_continue_offered():
    viewing = Viewing()
    viewing.show("page", Shown(NO_CONVERSATION))
    frames = _frames(viewing, switch_after=None)
    assert [(f[3], f[5]) for f in frames[:4]] == [(7, "a"), (7, "ab"), (7, "abc"), (7, "abcd")]
    assert frames[-1][:4] == (SKIP,) * 4 and frames[-1][4].visible is True


def test_the_page_cannot_switch_between_a_replys_check_and_its_update_being_sent():
    """Gradio sends a generator's output before it resumes the generator: until then the page is held
    (`show` waits), and it is free while the reply computes its next token."""
    viewing = Viewing()
    viewing.show("page", Shown(NO_CONVERSATION))
    held_while_computing = []

    def updates():
        for update in _reply(viewing, switch_after=None):
            held_while_computing.append(viewing._page("page").locked())
            yield update

    frames = turn(updates(), NO_CONVERSATION, (viewing, "page"))
    for _ in range(3):
        next(frames)
        assert viewing._page("page").locked()
    frames.close()
    assert not viewing._page("page").locked() and held_while_computing == [False] * 3
