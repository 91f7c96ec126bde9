"""Replies read aloud on the page: the reply's text goes to a `SpokenReply` as it streams, and the page's speaker is
an <audio> element that plays `/speech/reply/{key}` (`speech_route.py`), an MP3 stream of it made sentence by
sentence while the reply is still being written."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import gradio as gr

from pipeline.errors import UserError
from pipeline.service.requests import Update
from pipeline.speech.speech import Speech

QUIET = '<div class="studio-speaker"></div>'


def player(key: str, prefix: str) -> str:
    """The speaker playing the reply handed out under `key`."""
    return (f'<div class="studio-speaker"><audio id="{prefix}-speaker-audio" controls autoplay preload="auto" '
            f'src="/speech/reply/{key}"></audio></div>')


@contextlib.contextmanager
def read_aloud(speech: Speech, listener: str, on: bool, prefix: str) -> Iterator[tuple[Callable, str | None]]:
    """Around a reply's handler: yields (what to pass its updates through, the speaker to show, None when not read
    aloud). The updates' text feeds the reply spoken; a voice that cannot load is said once, and the reply goes on
    unspoken."""
    spoken = shown = None
    if on:
        try:
            key, spoken = speech.read_aloud(listener)
            shown = player(key, prefix)
        except UserError as e:
            gr.Warning(f"Replies are not read aloud: {e}")
    text = [""]

    def fed(updates: Iterator[Update]) -> Iterator[Update]:
        for update in updates:
            text[0] += update.text
            if spoken is not None:
                spoken.feed(text[0])
            yield update
    try:
        yield fed, shown
    finally:
        if spoken is not None:
            spoken.feed(text[0], final=True)


def read_message(speech: Speech, listener: str, text: str, prefix: str) -> str:
    """The speaker playing one message (its "Read aloud"), whatever was read before stopped."""
    key, spoken = speech.read_aloud(listener)
    spoken.feed(text, final=True)
    return player(key, prefix)
