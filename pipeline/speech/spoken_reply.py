"""A reply spoken while it is still being written: complete sentences (`SpeechQueue`) go to a thread that speaks
them in order, and the audio is taken from it as it comes, so the first sentence sounds while the model writes the
next ones. The sound is kept, so each reader hears it from the start (a browser may open a stream twice). Stopping
ends the speech between two sentences.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import numpy as np

from pipeline.speech.piper_voice import Voice
from pipeline.speech.speakable import SpeechQueue

END = None  # after a reply's last sentence
log = logging.getLogger(__name__)


class SpokenReply:
    """`feed(reply so far)` while it streams and once more with `final`; `sound()` yields its audio as it is made."""

    def __init__(self, voice: Voice, speed: float = 1.0):
        self.voice, self.speed, self.sample_rate = voice, speed, voice.sample_rate
        self.stopped = threading.Event()
        self._sentences = SpeechQueue()
        self._todo: queue.Queue[str | None] = queue.Queue()
        self._sound: list[np.ndarray] = []
        self._made = threading.Condition()  # a piece was added, or the speaking ended
        self._silent = False  # the speaking ended
        self._ended = False
        threading.Thread(target=self._speak, name="spoken-reply", daemon=True).start()

    def feed(self, reply: str, final: bool = False) -> None:
        """The reply as it stands (the whole text so far); `final`: it has ended."""
        if self._ended:
            return
        for sentence in self._sentences.ready(reply, final):
            self._todo.put(sentence)
        if final:
            self._ended = True
            self._todo.put(END)

    def stop(self) -> None:
        """No more speech (the sentence being spoken is cut at its end)."""
        self.stopped.set()
        self._ended = True
        self._todo.put(END)

    def sound(self, wait_s: float | None = None) -> Iterator[np.ndarray]:
        """The reply's audio from its start, int16 at `sample_rate`, piece by piece as it is made, until the last
        sentence has been spoken or speech stopped; `wait_s`: give up on a piece not made within it (`TimeoutError`:
        a reply that never ends)."""
        given = 0
        while True:
            with self._made:
                if not self._made.wait_for(lambda: len(self._sound) > given or self._silent, timeout=wait_s):
                    raise TimeoutError("no sound came")
                if given == len(self._sound):
                    return
                piece = self._sound[given]
            given += 1
            yield piece

    def _speak(self) -> None:
        try:
            while (sentence := self._todo.get()) is not END and not self.stopped.is_set():
                try:
                    for piece in self.voice.speak(sentence, self.speed, self.stopped):
                        with self._made:
                            self._sound.append(piece)
                            self._made.notify_all()
                except Exception as e:  # noqa: BLE001 - one sentence the voice cannot say; the next ones are said
                    log.warning("a sentence could not be spoken (%s: %s): %.80r", type(e).__name__, e, sentence)
        finally:
            with self._made:
                self._silent = True
                self._made.notify_all()
