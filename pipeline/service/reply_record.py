"""ReplyRecord: one turn saved as it happens, so a killed process or a closed tab loses nothing said."""

from __future__ import annotations

import os
import time

from pipeline.service.store import ConversationStore

# A reply in progress is written at most this often (and when it ends); $STUDIO_SAVE_EVERY_S changes it (the
# crash test sets 0, so a reply is on disk from its first words whatever the machine's speed).
SAVE_EVERY_S = float(os.environ.get("STUDIO_SAVE_EVERY_S", "2"))


class ReplyRecord:
    """One turn being saved: the question at once (None: another reply to the question the branch shown
    ends with), the reply as it grows (every `SAVE_EVERY_S`), and its end: "complete", or "cancelled"
    when stopped, cut off by a closed tab or failed."""

    def __init__(self, store: ConversationStore, user: str, conversation: int, question: str | None, model: str,
                 sampling: dict):
        self.store, self.user = store, user
        if question is not None:
            store.add(user, conversation, "user", question, model, sampling)
        self.message = store.add(user, conversation, "assistant", "", model, sampling, "streaming")
        self.saved_at = time.monotonic()
        self.ended = False

    def progress(self, text: str) -> None:
        if time.monotonic() - self.saved_at >= SAVE_EVERY_S:
            self.store.update(self.user, self.message, text, "streaming")
            self.saved_at = time.monotonic()

    def end(self, text: str, finish_reason: str) -> None:
        """Write the reply as it stands; only the first call counts."""
        if not self.ended:
            self.ended = True
            self.store.update(self.user, self.message, text, "cancelled" if finish_reason in ("cancelled", "error")
                              else "complete")
