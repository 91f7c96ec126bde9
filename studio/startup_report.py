"""The start-up report: what start-up and each tool's load did, one line each, printed as it happens,
kept for the page's "what runs where, and why", and handed to whoever waits on a load."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class StartupReport:
    """What start-up did, one line each: printed as it happens and kept for the UI's status."""

    def __init__(self, echo: bool = True):
        self.lines: list[str] = []
        self.echo = echo
        self._listeners: list[Callable[[str], None]] = []

    def say(self, line: str) -> None:
        self.lines.append(line)
        if self.echo:
            print(f"[studio] {line}", flush=True)
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
