"""How many replies each client has running or queued, with their Stop flags.

Why a limit: one client queueing 200 replies would starve the rest (the service's `MAX_IN_FLIGHT`).
A request of n replies (the API's `n`) holds n slots, all at once or none. A client with nothing in
flight may start one request of more replies than the limit (the API's `n` goes to 8, the engine's
batch): the limit stops a client piling up requests, not asking for the choices the API offers; while
those run, its further requests are refused as any busy client's are.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from pipeline.errors import UserError


class Busy(UserError):
    """A client already has its limit of replies in flight (the API answers 429)."""


class InFlight:
    """Each client's replies running or queued, with their Stop flags."""

    def __init__(self, limit: int):
        self.limit = limit
        self._flags: dict[str, list[tuple[str, threading.Event]]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self, client: str, tool: str, *cancels: threading.Event) -> Iterator[None]:
        """Hold one of `client`'s slots per reply (each with its Stop flag) while the block runs: all of
        them at once, or `Busy` (a request of n replies counts as n) when the client already has replies
        in flight and these would pass its limit."""
        entries = [(tool, cancel) for cancel in cancels]
        with self._lock:
            held = len(self._flags.get(client, []))
            if held and held + len(entries) > self.limit:
                raise Busy(self._refusal(held, len(entries)))
            flags = self._flags.setdefault(client, [])
            flags += entries
        try:
            yield
        finally:
            with self._lock:
                for entry in entries:
                    flags.remove(entry)
                if not flags:
                    del self._flags[client]

    def _refusal(self, held: int, asked: int) -> str:
        """Why `asked` more replies are refused to a client that has `held` in flight."""
        more = f", and {asked} more would pass its limit of {self.limit}" if asked > 1 else ""
        return f"this client already has {held} replies in progress{more}: wait for one to finish, or stop it"

    def cancel(self, client: str, tool: str | None) -> int:
        """Set `client`'s Stop flags (of `tool`'s replies, else all); how many were set."""
        with self._lock:
            hit = [flag for t, flag in self._flags.get(client, []) if tool is None or t == tool]
        for flag in hit:
            flag.set()
        return len(hit)
