"""The app's ears and voice: Whisper and a Piper voice, each loaded on first use and shared by the tabs and the API
(`--stt none` / `--voice none` leave one out, and what needs it says so)."""

from __future__ import annotations

import collections
import secrets
import threading
from collections.abc import Iterator

import numpy as np

from pipeline.errors import UserError
from pipeline.first_use import FirstUse
from pipeline.speech.piper_voice import Voice
from pipeline.speech.spoken_reply import SpokenReply
from pipeline.speech.transcribe import Transcriber, Transcript

MAX_SPOKEN_CHARS = 100_000  # a text to speak at once (about 2 hours of speech)
MOST_LISTENERS = 64  # readings kept (each holds its sound): pages long gone lose theirs, the oldest first


class Speech:
    """Also the replies being read aloud on pages: each handed out under an unguessable key (`read_aloud`), which a
    page's player fetches (`reading`); one at a time for each listener (a page's session)."""

    def __init__(self, ears: FirstUse[Transcriber] | None, voice: FirstUse[Voice] | None):
        self.ears, self.voice = ears, voice
        self._handed: dict[str, SpokenReply] = {}  # key → the reply read under it
        # listener → (key, the reply read to them now), the most recent last
        self._playing: collections.OrderedDict[str, tuple[str, SpokenReply]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def transcriber(self) -> Transcriber:
        if self.ears is None:
            raise UserError("speech to text is off in this app (started with --stt none)")
        return self.ears.get()

    def speaker(self) -> Voice:
        if self.voice is None:
            raise UserError("text to speech is off in this app (started with --voice none)")
        return self.voice.get()

    def transcribe(self, audio, **options) -> Transcript:
        """`Transcriber.transcribe`'s words of `audio`."""
        return self.transcriber().transcribe(audio, **options)

    def speak(self, text: str, speed: float = 1.0, cancel: threading.Event | None = None) -> Iterator[np.ndarray]:
        """`text`'s speech, a sentence at a time (`Voice.speak`), or `UserError` for an empty or too long text."""
        if not text.strip():
            raise UserError("there is no text to speak", param="input")
        if len(text) > MAX_SPOKEN_CHARS:
            raise UserError(f"the text is {len(text):,} characters; at most {MAX_SPOKEN_CHARS:,} are spoken at once: "
                            f"split it", param="input")
        return self.speaker().speak(text, speed, cancel)

    def spoken_reply(self, speed: float = 1.0) -> SpokenReply:
        """A reply to speak while it streams (`SpokenReply`)."""
        return SpokenReply(self.speaker(), speed)

    def read_aloud(self, listener: str) -> tuple[str, SpokenReply]:
        """(its key, a reply) to read to `listener`, whatever was read to them stopped."""
        spoken = self.spoken_reply()
        key = secrets.token_urlsafe(16)
        self.stop_reading(listener)
        with self._lock:
            self._handed[key], self._playing[listener] = spoken, (key, spoken)
            oldest = next(iter(self._playing)) if len(self._playing) > MOST_LISTENERS else None
        if oldest is not None:
            self.stop_reading(oldest)
        return key, spoken

    def reading(self, key: str) -> SpokenReply | None:
        """The reply handed out under `key` (None: no such key, or its listener has had another read since)."""
        with self._lock:
            return self._handed.get(key)

    def stop_reading(self, listener: str) -> None:
        """Stop what is read to `listener`, and forget it."""
        with self._lock:
            key, spoken = self._playing.pop(listener, (None, None))
            self._handed.pop(key, None)
        if spoken is not None:
            spoken.stop()
