"""ConversationStore: every user's conversations in one embedded SQLite database (the standard library's sqlite3).

Why SQLite: one file in the data folder, transactions that survive a killed process (WAL journal:
each message is committed when it is written, and a crash loses at most the statement in flight),
full-text search built in (FTS5), and two app processes on one folder share it safely (SQLite locks;
a writer waits `BUSY_TIMEOUT_S` for the other). Nothing here knows about the UI.

- Every query names its user: one user's conversations are invisible to another, whatever an id says.
- A message records the model and sampling settings that produced it, and its state: "complete", or
  "cancelled" for a reply stopped or cut off (saved as it stood).
- Nothing a user made is lost by one click: a message hangs under the one before it, so a regenerated
  reply or an edited question is another *version* beside the old one (`open` shows the branch that
  ends at the conversation's head, each message with its versions; `choose` switches branch), and a
  deleted conversation can be restored for `UNDO_S` seconds before it is purged.
- An image-chat conversation's image is stored once by content hash (the same photo in ten
  conversations is one row).
- The schema has a version (`PRAGMA user_version`); migrations (`store_schema`) run in order at open.
- A damaged database (one that does not open as SQLite, or fails its integrity check) never stops the app:
  it is moved aside under a dated name, a fresh one is started, and `notice` says so plainly. A healthy one
  that another program holds locked is never moved: it is waited for (`BUSY_TIMEOUT_S`), then refused in one
  line. A reply's messages are written through `StoreWriter`, which waits out such a lock as long as it lasts.
- A reply cut by a crash (left "streaming") is marked "interrupted" when the store next opens.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.service.store_schema import MIGRATIONS, title_from
from pipeline.service.store_writer import StoreLocked, StoreWriter, is_locked
from pipeline.service.tools import Tool

FILE = "conversations.sqlite3"
BUSY_TIMEOUT_S = 10
CLOSE_WITHIN_S = 10  # at shutdown, the longest queued writes may wait for another program's lock
UNDO_S = 10  # a deleted conversation can be restored this long
HEAD = -1  # `add`'s default parent: the end of the branch shown
PATH = """WITH RECURSIVE path(id) AS (SELECT head FROM conversations WHERE id = ?
          UNION ALL SELECT m.parent FROM messages m JOIN path ON m.id = path.id WHERE m.parent IS NOT NULL)
          SELECT m.id, m.parent, m.role, m.content, m.model, m.sampling, m.state, m.created, m.sources
          FROM messages m JOIN path ON m.id = path.id ORDER BY m.id"""


INTEGRITY = "the integrity check failed"


def _damaged(error: sqlite3.DatabaseError) -> bool:
    """Whether `error` says the file is not a readable SQLite database (the only case it is set aside)."""
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None and code & 0xFF in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return True
    return any(words in str(error) for words in ("not a database", "malformed", INTEGRITY))


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
            if is_locked(e):
                raise StoreLocked(f"the conversation database {self.path} stayed locked by another program for "
                                  f"{BUSY_TIMEOUT_S} s (a backup, or the sqlite3 shell?): close it, then start "
                                  f"again") from None
            if not _damaged(e):
                raise UserError(f"the conversation database {self.path} cannot be opened ({e}): check the data "
                                f"folder's permissions and free space") from None
            self._db = self._set_aside(e)
        self.writer = StoreWriter(self.path)
        self.later(self._mark_interrupted)

    # ---- opening ------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError(INTEGRITY)
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
        """Each step in one transaction that reads the version again, so two processes opening an old
        database at once run it once. A current one is only read: another program's write lock does not
        stop the app from starting."""
        if db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS):
            return
        for number, statements in enumerate(MIGRATIONS):
            db.execute("BEGIN IMMEDIATE")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                db.execute("ROLLBACK")
                raise UserError(f"the conversation database was written by a newer version of the app (schema "
                                f"{version}, this one knows {len(MIGRATIONS)}): update the app")
            if version == number:
                for statement in statements:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {number + 1}")
            db.execute("COMMIT")

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
        """Write what is queued (waiting `CLOSE_WITHIN_S` at most for another program's lock), then close."""
        unwritten = self.writer.close(CLOSE_WITHIN_S)
        if unwritten:
            print(f"[studio] {unwritten} conversation writes were not saved: another program held the database "
                  f"locked", flush=True)
        with self._lock:
            self._db.close()

    def later(self, fn, *args) -> Future:
        """`fn(*args)` (a write of this store's) done by the writer, after every write queued before it."""
        return self.writer.later(fn, *args)

    def _mark_interrupted(self) -> None:
        with self._transaction() as db:
            db.execute("UPDATE messages SET state = 'interrupted' WHERE state = 'streaming'")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                if is_locked(e):
                    raise StoreLocked("the conversation database is locked by another program (a backup, or the "
                                      "sqlite3 shell?): try again once it is closed") from None
                raise
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    @staticmethod
    def _owned(db: sqlite3.Connection, user: str, conversation: int) -> sqlite3.Row:
        """The conversation's row if it is `user`'s and not deleted, else a `UserError`."""
        row = db.execute("SELECT * FROM conversations WHERE id = ? AND user = ? AND deleted IS NULL",
                         (conversation, user)).fetchone()
        if row is None:
            raise UserError(f"there is no conversation {conversation} of yours")
        return row

    # ---- conversations ------------------------------------------------------------------------

    def create(self, user: str, tool: str, title: str = "", system: str | None = None,
               image: bytes | None = None, question: str = "", collection: str | None = None) -> int:
        """A new conversation of `user` in `tool` ("chat" or "image chat"); `image` is its picture's file
        bytes. A `title` given here is kept; else it follows the first question, `question` until that
        is stored (so the list names the conversation the moment it is sent). `collection`: the document
        collection it is answered from."""
        now = time.time()
        with self._transaction() as db:
            key = None
            if image is not None:
                key = hashlib.sha256(image).hexdigest()
                db.execute("INSERT OR IGNORE INTO images(hash, data) VALUES (?, ?)", (key, image))
            cursor = db.execute("INSERT INTO conversations(user, tool, title, system, image, created, updated, renamed, "
                                "collection) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                (user, tool, title or (title_from(question) if question else ""), system, key, now,
                                 now, bool(title), collection))
            return cursor.lastrowid

    def list(self, user: str, tool: str | None = None) -> list[dict[str, Any]]:
        """`user`'s conversations, newest first."""
        self._purge()
        rows = self._query("SELECT id, tool, title, updated, image IS NOT NULL AS has_image FROM conversations "
                           "WHERE user = ? AND deleted IS NULL AND (? IS NULL OR tool = ?) "
                           "ORDER BY updated DESC, id DESC", (user, tool, tool))
        return [dict(r) for r in rows]

    def open(self, user: str, conversation: int) -> dict[str, Any]:
        """A conversation with the messages of the branch shown (each with `versions`: the ids of the
        messages in its place, oldest first, itself among them) and its image's bytes, if it has one."""
        with self._lock:
            found = dict(self._owned(self._db, user, conversation))
            image = self._db.execute("SELECT data FROM images WHERE hash = ?", (found["image"],)).fetchone()
            path = self._db.execute(PATH, (conversation,)).fetchall()
            places = self._db.execute("SELECT id, parent, role FROM messages WHERE conversation = ? ORDER BY id",
                                      (conversation,)).fetchall()
        versions: dict[tuple, list[int]] = {}
        for m in places:
            versions.setdefault((m["parent"], m["role"]), []).append(m["id"])
        found["image_data"] = image["data"] if image is not None else None
        found["messages"] = [{**dict(m), "sampling": json.loads(m["sampling"]) if m["sampling"] else None,
                              "sources": json.loads(m["sources"]) if m["sources"] else None,
                              "versions": versions[(m["parent"], m["role"])]} for m in path]
        return found

    def rename(self, user: str, conversation: int, title: str) -> None:
        """The user's own title (it no longer follows the first question)."""
        title = " ".join(str(title).split())
        if not title:
            raise UserError("a title cannot be empty")
        with self._transaction() as db:
            self._owned(db, user, conversation)
            db.execute("UPDATE conversations SET title = ?, renamed = 1 WHERE id = ?", (title[:200], conversation))

    def set_collection(self, user: str, conversation: int, collection: str | None) -> None:
        """The document collection the conversation is answered from from now on (None: none)."""
        with self._transaction() as db:
            self._owned(db, user, conversation)
            db.execute("UPDATE conversations SET collection = ? WHERE id = ?", (collection, conversation))

    def delete(self, user: str, conversation: int) -> str:
        """Delete a conversation (`restore` brings it back for `UNDO_S` seconds); its title."""
        with self._transaction() as db:
            title = self._owned(db, user, conversation)["title"]
            db.execute("UPDATE conversations SET deleted = ? WHERE id = ?", (time.time(), conversation))
        self._purge()
        return title

    def restore(self, user: str, conversation: int) -> None:
        """Undo `delete`, if it was less than `UNDO_S` seconds ago."""
        self._purge()
        with self._transaction() as db:
            if not db.execute("UPDATE conversations SET deleted = NULL WHERE id = ? AND user = ? AND deleted IS NOT NULL",
                              (conversation, user)).rowcount:
                raise UserError(f"conversation {conversation} cannot be restored: it was deleted for good "
                                f"({UNDO_S} s after Delete) or is not yours")

    def _purge(self) -> None:
        """Delete for good what was deleted more than `UNDO_S` ago, with its messages (and images nothing else
        shows). A read first: listing, which calls this, takes no write lock when nothing is due."""
        due = time.time() - UNDO_S
        if not self._query("SELECT 1 FROM conversations WHERE deleted < ? LIMIT 1", (due,)):
            return
        with self._transaction() as db:
            if db.execute("DELETE FROM conversations WHERE deleted < ?", (due,)).rowcount:
                db.execute("DELETE FROM images WHERE hash NOT IN "
                           "(SELECT image FROM conversations WHERE image IS NOT NULL)")

    def search(self, user: str, text: str) -> list[dict[str, Any]]:
        """`user`'s conversations whose title holds every word of `text`, or one of whose messages does
        (with a snippet), case-insensitively, newest first."""
        words = "".join(c if c.isalnum() else " " for c in text).split()  # no FTS or LIKE syntax from users
        if not words:
            return []
        titled = self._query(
            "SELECT id, tool, title, updated, title AS snippet FROM conversations WHERE user = ? AND deleted IS NULL "
            "AND " + " AND ".join(["title LIKE ?"] * len(words)), (user, *(f"%{w}%" for w in words)))
        query = " ".join(f'"{w}"' for w in words)  # each word a quoted term
        said = self._query(
            "SELECT c.id, c.tool, c.title, c.updated, snippet(messages_text, 0, '[', ']', '…', 12) AS snippet "
            "FROM messages_text JOIN messages m ON m.id = messages_text.rowid "
            "JOIN conversations c ON c.id = m.conversation "
            "WHERE messages_text MATCH ? AND c.user = ? AND c.deleted IS NULL ORDER BY c.updated DESC, rank",
            (query, user))
        seen: dict[int, dict[str, Any]] = {}
        for r in [*titled, *said]:
            seen.setdefault(r["id"], dict(r))
        return sorted(seen.values(), key=lambda c: -c["updated"])

    # ---- messages and their versions ----------------------------------------------------------

    def add(self, user: str, conversation: int, role: str, content: str, model: str | None = None,
            sampling: dict | None = None, state: str = "complete", parent: int | None = HEAD) -> int:
        """Append a message under `parent` (by default the end of the branch shown; None: first), committed
        now; it becomes the end of the branch shown."""
        now = time.time()
        with self._transaction() as db:
            row = self._owned(db, user, conversation)
            parent = row["head"] if parent == HEAD else parent
            if parent is not None and not db.execute("SELECT 1 FROM messages WHERE id = ? AND conversation = ?",
                                                     (parent, conversation)).fetchone():
                raise UserError(f"message {parent} is not in conversation {conversation}")
            cursor = db.execute("INSERT INTO messages(conversation, parent, role, content, model, sampling, state, "
                                "created) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                (conversation, parent, role, content, model, json.dumps(sampling) if sampling else None,
                                 state, now))
            self._show(db, row, cursor.lastrowid, now)
            return cursor.lastrowid

    def update(self, user: str, message: int, content: str, state: str, sources: list[dict] | None = None) -> None:
        """A reply in progress saved as it stands (state "streaming", then "complete" or "cancelled"; one a
        crash cut is "interrupted" after the next start), with the document sources it cited."""
        with self._transaction() as db:
            owned = db.execute("SELECT 1 FROM messages m JOIN conversations c ON c.id = m.conversation "
                               "WHERE m.id = ? AND c.user = ?", (message, user)).fetchone()
            if owned is None:
                raise UserError(f"there is no message {message} of yours")
            db.execute("UPDATE messages SET content = ?, state = ?, sources = ? WHERE id = ?",
                       (content, state, json.dumps(sources) if sources else None, message))

    def rewind_last_turn(self, user: str, conversation: int, keep_question: bool) -> None:
        """Make room for another version of the last exchange: the branch shown ends before the last reply
        (`keep_question`: regenerate) or before the last question (edit); both stay as versions."""
        with self._transaction() as db:
            row = self._owned(db, user, conversation)
            asked = [m for m in db.execute(PATH, (conversation,)).fetchall() if m["role"] == "user"]
            if not asked:
                raise UserError("there is no message of yours in this conversation to answer again")
            head = asked[-1]["id"] if keep_question else asked[-1]["parent"]
            self._show(db, row, head, row["updated"])

    def choose(self, user: str, conversation: int, message: int) -> None:
        """Show the branch through `message` (one of the versions `open` lists), to its newest end."""
        with self._transaction() as db:
            row = self._owned(db, user, conversation)
            if not db.execute("SELECT 1 FROM messages WHERE id = ? AND conversation = ?",
                              (message, conversation)).fetchone():
                raise UserError(f"message {message} is not in conversation {conversation}")
            head = message
            while (child := db.execute("SELECT MAX(id) FROM messages WHERE conversation = ? AND parent = ?",
                                       (conversation, head)).fetchone()[0]) is not None:
                head = child
            self._show(db, row, head, row["updated"])

    @staticmethod
    def _show(db: sqlite3.Connection, row: sqlite3.Row, head: int | None, updated: float) -> None:
        """End the branch shown at `head`; an automatic title follows the branch's first question."""
        db.execute("UPDATE conversations SET head = ?, updated = ? WHERE id = ?", (head, updated, row["id"]))
        if not row["renamed"]:
            first = db.execute(f"SELECT content FROM ({PATH}) WHERE role = 'user' LIMIT 1", (row["id"],)).fetchone()
            if first is not None:
                db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title_from(first["content"]), row["id"]))

    # ---- export and import --------------------------------------------------------------------

    def export(self, user: str, conversation: int | None = None) -> list[dict[str, Any]]:
        """One conversation, or all of `user`'s, as plain data that `import_` reads back: every version
        of every message (`id`, `parent`; `head` ends the branch shown), images as hex."""
        ids = [conversation] if conversation is not None else [c["id"] for c in self.list(user)]
        out = []
        for cid in ids:
            c = self.open(user, cid)
            messages = self._query("SELECT id, parent, role, content, model, sampling, state FROM messages "
                                   "WHERE conversation = ? ORDER BY id", (cid,))
            out.append({"tool": c["tool"], "title": c["title"], "renamed": bool(c["renamed"]), "system": c["system"],
                        "image": c["image_data"].hex() if c["image_data"] is not None else None, "head": c["head"],
                        "messages": [{**dict(m), "sampling": json.loads(m["sampling"]) if m["sampling"] else None}
                                     for m in messages]})
        return out

    def import_(self, user: str, conversations: list[dict[str, Any]]) -> list[int]:
        """Conversations from `export` (or plain message lists, one after another) into `user`'s, as new
        ones; a malformed entry is a `UserError`."""
        ids = []
        for i, c in enumerate(conversations):
            if not isinstance(c, dict) or c.get("tool") not in (Tool.CHAT, Tool.IMAGE_CHAT) or \
                    not isinstance(c.get("messages"), list):
                raise UserError(f"conversation {i} of the file is not one this app exported")
            image = bytes.fromhex(c["image"]) if c.get("image") else None
            title = str(c.get("title") or "") if c.get("renamed", True) else ""
            cid = self.create(user, c["tool"], title, c.get("system"), image)
            new: dict[object, int] = {}  # the file's message ids → ours
            for m in c["messages"]:
                above = m.get("parent") if isinstance(m, dict) else None
                if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system") or \
                        not isinstance(m.get("id", 0), int) or above is not None and (
                        not isinstance(above, int) or above not in new):
                    raise UserError(f"conversation {i} of the file has a malformed message")
                parent = new[above] if above is not None else None if "parent" in m else HEAD
                new[m.get("id", len(new))] = self.add(user, cid, m["role"], str(m.get("content", "")), m.get("model"),
                                                      m.get("sampling"), m.get("state") or "complete", parent)
            if isinstance(c.get("head"), int) and c["head"] in new:
                self.choose(user, cid, new[c["head"]])
            ids.append(cid)
        return ids
