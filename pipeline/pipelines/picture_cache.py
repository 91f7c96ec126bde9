"""The pictures image chat has encoded lately, by content: a conversation's follow-ups, and two requests
about one picture, encode it once."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from pipeline.errors import UserError

T = TypeVar("T")
SIZE = 16  # pictures kept (MiniGPT-4: 32 × 4096 floats each for Vicuna-7B)


class PictureCache(Generic[T]):
    """Encoded pictures by content key, the oldest dropped past `SIZE`; `runs` counts the encodes."""

    def __init__(self):
        self.items: collections.OrderedDict[str, T] = collections.OrderedDict()
        self._lock = threading.Lock()  # one encode at a time: a second request for the picture finds it
        self.runs = 0

    def get(self, key: str, encode: Callable[[], T]) -> T:
        """The picture under `key`, encoded by `encode` the first time (a GPU out of memory: a `UserError`)."""
        with self._lock:
            if key not in self.items:
                try:
                    self.items[key] = encode()
                except torch.OutOfMemoryError:
                    raise UserError("the GPU ran out of memory encoding this image") from None
                self.runs += 1
                while len(self.items) > SIZE:
                    self.items.popitem(last=False)
            self.items.move_to_end(key)
            return self.items[key]

    def clear(self) -> None:
        with self._lock:
            self.items.clear()
