"""The conversation database's schema, step by step, and the automatic title rule (a leaf: the store
and its tests read it)."""

from __future__ import annotations

import re

TITLE_CHARS = 60

MIGRATIONS: list[list[str]] = [  # MIGRATIONS[i]: the statements taking the schema from version i to i + 1
    [
        """CREATE TABLE IF NOT EXISTS conversations (
            id INTEGER PRIMARY KEY, user TEXT NOT NULL, tool TEXT NOT NULL, title TEXT NOT NULL, system TEXT,
            image TEXT REFERENCES images(hash), created REAL NOT NULL, updated REAL NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS conversations_by_user ON conversations(user, updated DESC)",
        """CREATE TABLE IF NOT EXISTS messages (
            id INTEGER PRIMARY KEY, conversation INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL, content TEXT NOT NULL, model TEXT, sampling TEXT,
            state TEXT NOT NULL DEFAULT 'complete', created REAL NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation, id)",
        "CREATE TABLE IF NOT EXISTS images (hash TEXT PRIMARY KEY, data BLOB NOT NULL)",
        "CREATE VIRTUAL TABLE IF NOT EXISTS messages_text USING fts5(content, content='messages', content_rowid='id')",
        """CREATE TRIGGER IF NOT EXISTS messages_added AFTER INSERT ON messages BEGIN
            INSERT INTO messages_text(rowid, content) VALUES (new.id, new.content); END""",
        """CREATE TRIGGER IF NOT EXISTS messages_removed AFTER DELETE ON messages BEGIN
            INSERT INTO messages_text(messages_text, rowid, content) VALUES ('delete', old.id, old.content); END""",
        """CREATE TRIGGER IF NOT EXISTS messages_changed AFTER UPDATE OF content ON messages BEGIN
            INSERT INTO messages_text(messages_text, rowid, content) VALUES ('delete', old.id, old.content);
            INSERT INTO messages_text(rowid, content) VALUES (new.id, new.content); END""",
    ],
    [  # versions: each message hangs under the one before it on its branch; `head` ends the branch shown
        "ALTER TABLE messages ADD COLUMN parent INTEGER",
        "ALTER TABLE conversations ADD COLUMN head INTEGER",
        "ALTER TABLE conversations ADD COLUMN renamed INTEGER NOT NULL DEFAULT 0",  # the user chose the title
        "ALTER TABLE conversations ADD COLUMN deleted REAL",  # when it was deleted (undo until it is purged)
        "UPDATE messages SET parent = (SELECT MAX(p.id) FROM messages p WHERE p.conversation = messages.conversation "
        "AND p.id < messages.id)",
        "UPDATE conversations SET head = (SELECT MAX(id) FROM messages WHERE conversation = conversations.id)",
        "CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(conversation, parent)",
    ],
    [  # documents: the collection a conversation is answered from, the sources each reply cited (JSON)
        "ALTER TABLE conversations ADD COLUMN collection TEXT",
        "ALTER TABLE messages ADD COLUMN sources TEXT",
    ],
]

MARKUP = [  # markdown that says how text looks, not what it says: (pattern, replacement)
    (re.compile(r"```[^\n]*"), " "),  # code fences and their language
    (re.compile(r"!?\[([^\]]*)\]\([^)]*\)"), r"\1"),  # links and images: their text
    (re.compile(r"^\s*(#{1,6}|>|[-*+](?=\s)|\d+[.)](?=\s))", re.MULTILINE), " "),  # headings, quotes, list marks
    (re.compile(r"`+|(?<!\w)[*_~]+|[*_~]+(?!\w)"), ""),  # inline code, emphasis
    (re.compile(r"\|"), " "),  # table bars
]


def plain_text(markdown: str) -> str:
    """`markdown` as words on one line (a title shows what was asked, not its formatting)."""
    for pattern, replacement in MARKUP:
        markdown = pattern.sub(replacement, markdown)
    return " ".join(markdown.split())


def title_from(question: str) -> str:
    """A conversation's automatic title: its first question as plain text on one line, cut at a word."""
    line = plain_text(question)
    if len(line) <= TITLE_CHARS:
        return line or "New conversation"
    return line[:TITLE_CHARS].rsplit(" ", 1)[0] + "…"
