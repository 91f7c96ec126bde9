"""ReplyRecord: one turn saved as it happens, so a killed process or a closed tab loses nothing said.

Written through the store's writer (`StoreWriter`): in order, off the reply's thread, so another program
holding the database locked delays the saving, never the reply."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future

from pipeline.service.store import ConversationStore
from pipeline.service.store_writer import soon

# A reply in progress is written at most this often (and when it ends); $STUDIO_SAVE_EVERY_S changes it (the
# crash test sets 0, so a reply is on disk from its first words whatever the machine's speed).
SAVE_EVERY_S = float(os.environ.get("STUDIO_SAVE_EVERY_S", "2"))


class ReplyRecord:
    """One turn being saved: the question at once (None: another reply to the question the branch shown
    ends with), the reply as it grows (every `SAVE_EVERY_S`, one write waiting at most), and its end:
    "complete", or "cancelled" when stopped, cut off by a closed tab or failed. `conversation` may be the
    future of one being created (queued before)."""

    def __init__(self, store: ConversationStore, user: str, conversation: int | Future, question: str | None,
                 model: str, sampling: dict):
        self.store, self.user = store, user
        if question is not None:
            store.later(store.add, user, conversation, "user", question, model, sampling)
        self.message = store.later(store.add, user, conversation, "assistant", "", model, sampling, "streaming")
        self.written = self.message  # the last write queued
        self.saved_at = time.monotonic()
        self.ended = False

    def progress(self, text: str) -> None:
        if time.monotonic() - self.saved_at >= SAVE_EVERY_S and self.written.done():
            self.written = self.store.later(self.store.update, self.user, self.message, text, "streaming")
            self.saved_at = time.monotonic()

    def end(self, text: str, finish_reason: str, sources: list[dict] | None = None) -> None:
        """Write the reply as it stands, with the document `sources` it cited, waiting for it briefly (`soon`), so
        that what a front end reads next has it, unless another program holds the database locked; only the first
        call counts."""
        if not self.ended:
            self.ended = True
            self.written = self.store.later(self.store.update, self.user, self.message, text,
                                            "cancelled" if finish_reason in ("cancelled", "error") else "complete",
                                            sources)
            soon(self.written)
