"""Long work run in a thread while the caller streams its progress lines (loads, switches, downloads)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator
from typing import TypeVar

T = TypeVar("T")


def lines_of(work: Callable[[Callable[[str], None]], T], name: str) -> Generator[str, None, T]:
    """Run `work(say)` in a thread named `name`; yield each line it says as it says it, then return what
    it returned (`result = yield from lines_of(…)`), or raise what it raised, in the caller's thread."""
    lines: queue.SimpleQueue = queue.SimpleQueue()
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(work(lines.put))
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread below
            outcome.append(e)
        finally:
            lines.put(None)

    threading.Thread(target=run, name=name, daemon=True).start()
    while (line := lines.get()) is not None:
        yield line
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
