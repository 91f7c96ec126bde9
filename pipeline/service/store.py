"""ConversationStore: every user's conversations in one embedded SQLite database (the standard library's sqlite3).

Why SQLite: one file in the data folder, transactions that survive a killed process (WAL journal:
each message is committed when it is written, and a crash loses at most the statement in flight),
full-text search built in (FTS5), and two app processes on one folder share it safely (SQLite locks;
a writer waits `BUSY_TIMEOUT_S` for the other). Nothing here knows about the UI.

- Every query names its user: one user's conversations are invisible to another, whatever an id says.
- A message records the model and sampling settings that produced it, and its state: "complete", or
  "cancelled" for a reply stopped or cut off (saved as it stood).
- An image-chat conversation's image is stored once by content hash (the same photo in ten
  conversations is one row).
- The schema has a version (`PRAGMA user_version`) and migrations run in order at open.
- A damaged or unreadable database never stops the app: it is moved aside under a dated name, a
  fresh one is started, and `notice` says so plainly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.service.tools import Tool

FILE = "conversations.sqlite3"
BUSY_TIMEOUT_S = 10
TITLE_CHARS = 60

MIGRATIONS = [  # MIGRATIONS[i] takes the schema from version i to i + 1; idempotent (two processes may race)
    """
    CREATE TABLE IF NOT EXISTS conversations (
        id INTEGER PRIMARY KEY,
        user TEXT NOT NULL,
        tool TEXT NOT NULL,
        title TEXT NOT NULL,
        system TEXT,
        image TEXT REFERENCES images(hash),
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE INDEX IF NOT EXISTS conversations_by_user ON conversations(user, updated DESC);
    CREATE TABLE IF NOT EXISTS messages (
        id INTEGER PRIMARY KEY,
        conversation INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        model TEXT,
        sampling TEXT,
        state TEXT NOT NULL DEFAULT 'complete',
        created REAL NOT NULL
    );
    CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation, id);
    CREATE TABLE IF NOT EXISTS images (hash TEXT PRIMARY KEY, data BLOB NOT NULL);
    CREATE VIRTUAL TABLE IF NOT EXISTS messages_text USING fts5(content, content='messages', content_rowid='id');
    CREATE TRIGGER IF NOT EXISTS messages_added AFTER INSERT ON messages BEGIN
        INSERT INTO messages_text(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER IF NOT EXISTS messages_removed AFTER DELETE ON messages BEGIN
        INSERT INTO messages_text(messages_text, rowid, content) VALUES ('delete', old.id, old.content);
    END;
    CREATE TRIGGER IF NOT EXISTS messages_changed AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO messages_text(messages_text, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO messages_text(rowid, content) VALUES (new.id, new.content);
    END;
    """,
]


def title_from(question: str) -> str:
    """A conversation's automatic title: its first question, on one line, cut at a word."""
    line = " ".join(question.split())
    if len(line) <= TITLE_CHARS:
        return line or "New conversation"
    return line[:TITLE_CHARS].rsplit(" ", 1)[0] + "…"


class ConversationStore:
    def __init__(self, folder: Path):
        """Open (or create) the store in `folder`; `notice` says if a damaged database was set aside."""
        self.path = Path(folder) / FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.notice: str | None = None
        self._lock = threading.Lock()  # one connection, shared by the app's threads
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as e:
            self._db = self._set_aside(e)

    # ---- opening ------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("the integrity check failed")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA foreign_keys=ON")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: a commit survives a killed process
            self._migrate(db)
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            raise UserError(f"the conversation database was written by a newer version of the app (schema "
                            f"{version}, this one knows {len(MIGRATIONS)}): update the app")
        for number in range(version, len(MIGRATIONS)):  # each step one transaction, with its version
            db.executescript(f"BEGIN IMMEDIATE;\n{MIGRATIONS[number]}\nPRAGMA user_version = {number + 1};\nCOMMIT;")

    def _set_aside(self, error: Exception) -> sqlite3.Connection:
        """Move the damaged database (and its journal files) aside under a dated name; start a fresh one."""
        stamp = time.strftime("%Y-%m-%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.stem}.damaged-{stamp}{self.path.suffix}")
        for suffix in ("", "-wal", "-shm"):
            part = Path(str(self.path) + suffix)
            if part.exists():
                part.rename(str(aside) + suffix)
        self.notice = (f"The conversation database could not be read ({error}); it was moved aside to {aside.name} "
                       f"and a new, empty one was started.")
        return self._open()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---- conversations ------------------------------------------------------------------------

    def create(self, user: str, tool: str, title: str = "", system: str | None = None,
               image: bytes | None = None) -> int:
        """A new conversation of `user` in `tool` ("chat" or "image chat"); `image` is its picture's file bytes."""
        now = time.time()
        with self._transaction() as db:
            key = None
            if image is not None:
                key = hashlib.sha256(image).hexdigest()
                db.execute("INSERT OR IGNORE INTO images(hash, data) VALUES (?, ?)", (key, image))
            cursor = db.execute("INSERT INTO conversations(user, tool, title, system, image, created, updated) "
                                "VALUES (?, ?, ?, ?, ?, ?, ?)", (user, tool, title, system, key, now, now))
            return cursor.lastrowid

    def list(self, user: str, tool: str | None = None) -> list[dict[str, Any]]:
        """`user`'s conversations, newest first."""
        rows = self._query("SELECT id, tool, title, updated, image IS NOT NULL AS has_image FROM conversations "
                           "WHERE user = ? AND (? IS NULL OR tool = ?) ORDER BY updated DESC, id DESC",
                           (user, tool, tool))
        return [dict(r) for r in rows]

    def open(self, user: str, conversation: int) -> dict[str, Any]:
        """A conversation with its messages (and its image's bytes, if it has one)."""
        rows = self._query("SELECT c.*, i.data AS image_data FROM conversations c LEFT JOIN images i ON i.hash = c.image "
                           "WHERE c.id = ? AND c.user = ?", (conversation, user))
        if not rows:
            raise UserError(f"there is no conversation {conversation} of yours")
        found = dict(rows[0])
        found["messages"] = [
            {**dict(m), "sampling": json.loads(m["sampling"]) if m["sampling"] else None}
            for m in self._query("SELECT id, role, content, model, sampling, state, created FROM messages "
                                 "WHERE conversation = ? ORDER BY id", (conversation,))]
        return found

    def rename(self, user: str, conversation: int, title: str) -> None:
        title = " ".join(str(title).split())
        if not title:
            raise UserError("a title cannot be empty")
        self._owned_update(user, conversation, "UPDATE conversations SET title = ? WHERE id = ? AND user = ?",
                           (title[:200], conversation, user))

    def delete(self, user: str, conversation: int) -> None:
        """Delete a conversation and its messages (its image too, when nothing else shows it)."""
        with self._transaction() as db:
            gone = db.execute("DELETE FROM conversations WHERE id = ? AND user = ?", (conversation, user)).rowcount
            if not gone:
                raise UserError(f"there is no conversation {conversation} of yours")
            db.execute("DELETE FROM images WHERE hash NOT IN (SELECT image FROM conversations WHERE image IS NOT NULL)")

    def search(self, user: str, text: str) -> list[dict[str, Any]]:
        """`user`'s conversations whose title holds every word of `text`, or one of whose messages does
        (with a snippet), case-insensitively, newest first."""
        words = "".join(c if c.isalnum() else " " for c in text).split()  # no FTS or LIKE syntax from users
        if not words:
            return []
        titled = self._query(
            "SELECT id, tool, title, updated, title AS snippet FROM conversations WHERE user = ? AND "
            + " AND ".join(["title LIKE ?"] * len(words)), (user, *(f"%{w}%" for w in words)))
        query = " ".join(f'"{w}"' for w in words)  # each word a quoted term
        said = self._query(
            "SELECT c.id, c.tool, c.title, c.updated, snippet(messages_text, 0, '[', ']', '…', 12) AS snippet "
            "FROM messages_text JOIN messages m ON m.id = messages_text.rowid "
            "JOIN conversations c ON c.id = m.conversation "
            "WHERE messages_text MATCH ? AND c.user = ? ORDER BY c.updated DESC, rank", (query, user))
        seen: dict[int, dict[str, Any]] = {}
        for r in [*titled, *said]:
            seen.setdefault(r["id"], dict(r))
        return sorted(seen.values(), key=lambda c: -c["updated"])

    # ---- messages -----------------------------------------------------------------------------

    def add(self, user: str, conversation: int, role: str, content: str, model: str | None = None,
            sampling: dict | None = None, state: str = "complete") -> int:
        """Append a message (committed now); the first user message titles an untitled conversation."""
        now = time.time()
        with self._transaction() as db:
            row = db.execute("SELECT title FROM conversations WHERE id = ? AND user = ?", (conversation, user)).fetchone()
            if row is None:
                raise UserError(f"there is no conversation {conversation} of yours")
            cursor = db.execute("INSERT INTO messages(conversation, role, content, model, sampling, state, created) "
                                "VALUES (?, ?, ?, ?, ?, ?, ?)", (conversation, role, content, model,
                                                                  json.dumps(sampling) if sampling else None, state, now))
            title = row["title"] or (title_from(content) if role == "user" else "")
            db.execute("UPDATE conversations SET updated = ?, title = ? WHERE id = ?", (now, title, conversation))
            return cursor.lastrowid

    def update(self, user: str, message: int, content: str, state: str) -> None:
        """A reply in progress saved as it stands (state "streaming", then "complete" or "cancelled")."""
        with self._transaction() as db:
            owned = db.execute("SELECT 1 FROM messages m JOIN conversations c ON c.id = m.conversation "
                               "WHERE m.id = ? AND c.user = ?", (message, user)).fetchone()
            if owned is None:
                raise UserError(f"there is no message {message} of yours")
            db.execute("UPDATE messages SET content = ?, state = ? WHERE id = ?", (content, state, message))

    def drop_last_turn(self, user: str, conversation: int) -> None:
        """Remove the last user message and everything after it (regenerate, edit-and-resend)."""
        with self._transaction() as db:
            if not db.execute("SELECT 1 FROM conversations WHERE id = ? AND user = ?", (conversation, user)).fetchone():
                raise UserError(f"there is no conversation {conversation} of yours")
            last = db.execute("SELECT MAX(id) FROM messages WHERE conversation = ? AND role = 'user'",
                              (conversation,)).fetchone()[0]
            if last is not None:
                db.execute("DELETE FROM messages WHERE conversation = ? AND id >= ?", (conversation, last))

    def _owned_update(self, user: str, conversation: int, sql: str, args: tuple) -> None:
        with self._transaction() as db:
            if not db.execute(sql, args).rowcount:
                raise UserError(f"there is no conversation {conversation} of yours")

    # ---- export and import --------------------------------------------------------------------

    def export(self, user: str, conversation: int | None = None) -> list[dict[str, Any]]:
        """One conversation, or all of `user`'s, as plain data (images as hex) that `import_` reads back."""
        ids = [conversation] if conversation is not None else [c["id"] for c in self.list(user)]
        out = []
        for cid in ids:
            c = self.open(user, cid)
            out.append({"tool": c["tool"], "title": c["title"], "system": c["system"],
                        "image": c["image_data"].hex() if c["image_data"] is not None else None,
                        "messages": [{k: m[k] for k in ("role", "content", "model", "sampling", "state")}
                                     for m in c["messages"]]})
        return out

    def import_(self, user: str, conversations: list[dict[str, Any]]) -> list[int]:
        """Conversations from `export` into `user`'s (new ids); a malformed entry is a `UserError`."""
        ids = []
        for i, c in enumerate(conversations):
            if not isinstance(c, dict) or c.get("tool") not in (Tool.CHAT, Tool.IMAGE_CHAT) or \
                    not isinstance(c.get("messages"), list):
                raise UserError(f"conversation {i} of the file is not one this app exported")
            image = bytes.fromhex(c["image"]) if c.get("image") else None
            cid = self.create(user, c["tool"], str(c.get("title") or ""), c.get("system"), image)
            for m in c["messages"]:
                if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
                    raise UserError(f"conversation {i} of the file has a malformed message")
                self.add(user, cid, m["role"], str(m.get("content", "")), m.get("model"), m.get("sampling"),
                         m.get("state") or "complete")
            ids.append(cid)
        return ids


# A reply in progress is written at most this often (and when it ends); $STUDIO_SAVE_EVERY_S changes it (the
# crash test sets 0, so a reply is on disk from its first words whatever the machine's speed).
SAVE_EVERY_S = float(os.environ.get("STUDIO_SAVE_EVERY_S", "2"))


class ReplyRecord:
    """One turn being saved: the question at once, the reply as it grows (every `SAVE_EVERY_S`), and its
    end: "complete", or "cancelled" when stopped, cut off by a closed tab or failed."""

    def __init__(self, store: ConversationStore, user: str, conversation: int, question: str, model: str,
                 sampling: dict):
        self.store, self.user = store, user
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
