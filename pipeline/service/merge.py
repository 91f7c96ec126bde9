"""Several blocking iterators read as one: each runs on a thread of its own and pushes its items into
one queue, which the reader blocks on (nothing polls). The service reads a request's n choices so."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _Ended:
    error: BaseException | None


def merged(streams: Sequence[Iterator[T]], flags: Sequence[threading.Event]) -> Iterator[tuple[int, T]]:
    """(index, item) from `streams` as their items come; an error in one is raised here. A reader that
    stops early (that error, or it went away) sets every stream's stop flag in `flags` and waits for the
    streams to end, so none outlives it."""
    items: queue.SimpleQueue = queue.SimpleQueue()

    def pump(index: int, stream: Iterator[T]) -> None:
        try:
            for item in stream:
                items.put((index, item))
            items.put((index, _Ended(None)))
        except BaseException as e:  # noqa: BLE001 - raised again in the reader's thread
            items.put((index, _Ended(e)))

    for index, stream in enumerate(streams):
        threading.Thread(target=pump, args=(index, stream), daemon=True, name="merged-stream").start()
    left = len(streams)
    try:
        while left:
            index, item = items.get()
            if not isinstance(item, _Ended):
                yield index, item
                continue
            left -= 1
            if item.error is not None:
                raise item.error
    finally:
        if left:
            for flag in flags:
                flag.set()
            while left:
                left -= isinstance(items.get()[1], _Ended)
