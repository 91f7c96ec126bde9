"""The start-up report: what start-up and each tool's load did, one line each, kept for the page's
"what runs where, and why" and `/engine_status`, and handed to whoever waits on a load.

The terminal shows what a user needs (`tell`: what runs where, loading, ready, engine builds, fallbacks);
the details (`say`: backends and why, caches, sizes) only with `--verbose`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


def print_line(line: str) -> None:
    print(f"[studio] {line}", flush=True)


class StartupReport:
    """What start-up did, one line each: kept for the UI's status, printed to `out` (None: nowhere)
    as it happens, details only when `verbose`."""

    def __init__(self, out: Callable[[str], None] | None = print_line, verbose: bool = False):
        self.lines: list[str] = []
        self.told: list[str] = []  # those every user gets (the page's panel puts the details under them)
        self.out, self.verbose = out, verbose
        self._listeners: list[Callable[[str], None]] = []

    def tell(self, line: str) -> None:
        """A line for every user: printed always."""
        self._add(line, True)

    def say(self, line: str) -> None:
        """A detail: printed with `--verbose`, always kept."""
        self._add(line, False)

    def _add(self, line: str, told: bool) -> None:
        self.lines.append(line)
        if told:
            self.told.append(line)
        if (told or self.verbose) and self.out is not None:
            self.out(line)
        for listener in list(self._listeners):
            listener(line)

    @contextlib.contextmanager
    def listening(self, listener: Callable[[str], None]) -> Iterator[None]:
        """Also hand every line said inside the block to `listener` (a UI request waiting on a tool's load)."""
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)
