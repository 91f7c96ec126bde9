"""huggingface_hub's progress bars, turned into lines a person reads in the UI and the terminal.

`snapshot_download(tqdm_class=…)` creates its byte bars from the class given. A plain `tqdm` subclass
(not huggingface_hub's, which would hide itself away from a terminal) writes nowhere, and on each update
(once per read of `READ_BYTES`) reports the bytes of every file so far, at most every `EVERY_S`; it
also raises `DownloadCancelled` there when the user cancelled: the files already complete stay in the
cache, and the file in progress is dropped (huggingface_hub 1.x+ downloads each to a fresh temporary file).
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tqdm import tqdm

from pipeline.errors import UserError

EVERY_S = 0.5
READ_BYTES = 1 << 20  # huggingface_hub reads 10 MiB at a time unless told otherwise
CANCEL_HINT = "Cancel download in the Models tab stops it"  # on each line of a tool's first-use download
T = TypeVar("T")


class DownloadCancelled(Exception):
    """The user pressed Cancel (or Ctrl+C, in `interruptible`)."""


def cancelled(name: str, again: str) -> UserError:
    """What the user is told after cancelling the download of `name`; `again`: what starts it again."""
    return UserError(f"the download of {name} was cancelled: {again} to fetch what is still missing (the files "
                     f"already complete are kept)")


class FirstUseDownload:
    """The first-use download a tool's load may be making (the host loads one tool at a time): its Cancel
    flag, and whether one is running, so that Cancel with none says so instead of nothing."""

    def __init__(self):
        self.cancel = threading.Event()
        self._running = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[threading.Event]:
        """Around a load's look for its files (a download if they are missing): the flag its progress reads."""
        self.cancel.clear()
        self._running += 1
        try:
            yield self.cancel
        finally:
            self._running -= 1

    def stop(self) -> bool:
        """Cancel the download running now; False where none is."""
        if not self._running:
            return False
        self.cancel.set()
        return True


def interruptible(download: Callable[[], T], cancel: threading.Event) -> T:
    """`download()` (given a progress class over `cancel`) in a thread of its own, so that a Ctrl+C in this
    one sets `cancel` and huggingface_hub's download threads stop at their next read. Interrupted in
    its own wait, `snapshot_download` would let every file finish before the process could end."""
    with ThreadPoolExecutor(1, thread_name_prefix="download") as pool:
        job = pool.submit(download)
        try:
            return job.result()
        except KeyboardInterrupt:
            cancel.set()
            raise


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
