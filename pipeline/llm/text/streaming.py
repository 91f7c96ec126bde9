"""Token ids → text deltas that are safe to show: whole UTF-8 characters, no control tokens,
stop strings cut off.

A stop string ("###", "<|im_end|>" spelled as text…) can arrive split over several tokens, so
text that might be the start of one is held back until it is known not to be.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from pipeline.llm.text.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._hidden = tokenizer.special_ids
        self._stops = tuple(s for s in stop_strings if s)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Text that became final with this token ('' while a character or a stop is incomplete)."""
        if self.stopped or token_id in self._hidden:
            return ""
        return self._release(self._utf8.decode(self._tokenizer.token_bytes(token_id)))

    def finish(self) -> str:
        """Whatever is still held at the end of generation (an unfinished character shows as �)."""
        if self.stopped:
            return ""
        text = self._held + self._utf8.decode(b"", final=True)
        self._held = ""
        return text

    def _release(self, piece: str) -> str:
        text = self._held + piece
        cuts = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if cuts:
            self.stopped, self._held = True, ""
            return text[:min(cuts)]
        hold = max((n for s in self._stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]
