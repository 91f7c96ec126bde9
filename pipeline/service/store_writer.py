"""StoreWriter: the conversation store's writes that must not fail a reply, done in order on a thread of their own.

Why: another program may hold the database's write lock for longer than SQLite's busy timeout (a backup, the
sqlite3 shell left in a transaction). A reply written on the request's thread then failed after 10 s, neither
answered nor saved. Here the reply goes on; its messages wait in order and are written once the lock is
released. While waiting, the writer does not hold the store's connection: the app's reads go on.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

PROBE_WAIT_S = 10  # each probe waits this long inside SQLite (its busy handler) before it is asked again
SOON_S = 2.0  # how long a reply waits for a write it would like to know about before going on without it


class StoreLocked(UserError):
    """Another program holds the conversation database's write lock (SQLITE_BUSY / SQLITE_LOCKED)."""


def is_locked(error: sqlite3.Error) -> bool:
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(error) or "busy" in str(error)


def soon(future: Future) -> Any:
    """The write's result if it is done within `SOON_S` (its error raised, a `UserError` among them), else
    the future itself: the database is locked and the write will be done later, in order."""
    try:
        return future.result(timeout=SOON_S)
    except TimeoutError:
        return future


class StoreWriter:
    """`later(fn, *args)` runs `fn(*args)` after every write queued before it; arguments that are futures
    of earlier writes (a message's id) are their results. A write that finds the database locked is tried
    again once a probe finds the lock released, as often as it takes."""

    def __init__(self, path: Path):
        self.path = path
        self.waiting_since: float | None = None  # when a write first found the lock (None: not waiting)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="conversation-writer", daemon=True)
        self._thread.start()

    def later(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def pending(self) -> int:
        return self._queue.qsize()

    def close(self, within_s: float) -> int:
        """Write what is queued (for at most `within_s`), then stop; the writes left unwritten."""
        self._queue.put(None)
        self._thread.join(within_s)
        return self._queue.qsize() if self._thread.is_alive() else 0

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            while True:
                try:
                    future.set_result(fn(*(a.result() if isinstance(a, Future) else a for a in args)))
                except StoreLocked:
                    self._wait_until_unlocked()
                    continue
                except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
                    future.set_exception(e)
                self.waiting_since = None
                break

    def _wait_until_unlocked(self) -> None:
        """Until a write transaction of our own could begin: waited for (by SQLite's busy handler) on a
        connection of its own, so the store's connection stays free for reads meanwhile."""
        self.waiting_since = self.waiting_since or time.time()
        probe = sqlite3.connect(self.path, timeout=PROBE_WAIT_S, isolation_level=None)
        try:
            while True:
                try:
                    probe.execute("BEGIN IMMEDIATE")
                    probe.execute("ROLLBACK")
                    return
                except sqlite3.OperationalError as e:
                    if not is_locked(e):
                        return  # not a lock: the write itself will say what is wrong
        finally:
            probe.close()
