"""huggingface_hub's progress bars, turned into lines a person reads in the UI and the terminal.

`snapshot_download(tqdm_class=…)` creates its byte bars from the class given. A plain `tqdm` subclass
(not huggingface_hub's, which would hide itself away from a terminal) writes nowhere, and on each update
(once per read of `READ_BYTES`) reports the bytes of every file so far, at most every `EVERY_S`; it
also raises `DownloadCancelled` there when the user cancelled: the files already complete stay in the
cache, and the file in progress is dropped (huggingface_hub 1.x+ downloads each to a fresh temporary file).
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable

from tqdm import tqdm

EVERY_S = 0.5
READ_BYTES = 1 << 20  # huggingface_hub reads 10 MiB at a time unless told otherwise


class DownloadCancelled(Exception):
    """The user pressed Cancel."""


def size_text(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def progress_class(say: Callable[[str], None], cancel: threading.Event) -> type[tqdm]:
    """A tqdm class for one download: byte progress to `say`; `cancel` set stops the download."""
    state = {"said": 0.0, "start": time.monotonic()}

    class Progress(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            super().__init__(*args, **{**kwargs, "file": io.StringIO(), "disable": False})

        def update(self, n: float | None = 1) -> bool | None:
            if cancel.is_set():
                raise DownloadCancelled()
            out = super().update(n)
            if self.unit == "B" and self.total and time.monotonic() - state["said"] >= EVERY_S:
                state["said"] = time.monotonic()
                rate = self.n / max(time.monotonic() - state["start"], 1e-3)
                say(f"downloaded {size_text(self.n)} of {size_text(self.total)} "
                    f"({100 * self.n / self.total:.0f} %, {size_text(rate)}/s)")
            return out

    return Progress
