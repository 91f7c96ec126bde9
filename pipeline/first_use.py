"""A model loaded on first use, once, however many requests ask for it at the same time: the documents' embedder,
the speech models. The app starts without waiting for them; the first question that needs one waits for its load."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Model = TypeVar("Model")


class FirstUse(Generic[Model]):
    """The model `name`, made by `load` when `get` is first called."""

    def __init__(self, name: str, load: Callable[[], Model]):
        self.name, self._load = name, load
        self._model: Model | None = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def get(self) -> Model:
        """The model, loaded now if it is not yet (a failed load is tried again by the next call)."""
        with self._lock:
            if self._model is None:
                self._model = self._load()
            return self._model
