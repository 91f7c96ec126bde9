"""CUDA streams that no other live owner shares, and the gate between CUDA graph captures and other
threads' GPU work.

`torch.cuda.Stream()` hands out streams from a pool of 32 per priority, round-robin, so after 32 requests
two owners hold the same stream: an engine's thread then replayed its graphs on the very stream another
engine's thread was capturing on ("Cannot prepare for replay during capturing stage", and captures
invalidated: a speculating engine measuring its steps while a plain one decoded, H200, 2026-11-27). Each
engine takes its stream here (`own_stream`: one no live owner holds, given back as the engine closes), and
every capture runs on the one `capture_stream`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_claimed: set[tuple[int, int]] = set()  # (device, stream handle) held by a live owner
_lock = threading.Lock()


class _CaptureGate:
    """One CUDA graph capture at a time in the process, and none while another thread launches GPU work.

    Engines run on threads of their own (a chat model, a draft model, SAM) and capture at first use of a
    shape. Two captures at once shared torch's one default capture stream ("beginAllocateToPool: already
    recording to mempool_id", H200, two engines over one model); a capture in thread-local mode, on a
    stream no engine held, was still invalidated while another engine decoded (H200, 2026-11-27: a
    speculating engine measuring its steps beside a plain one). So work that launches on the GPU runs
    inside `launching()` (any number of threads at once, re-entrant), and `capturing()` waits for every
    other thread's launching to end and holds new ones back until the capture is done; a thread waiting
    to capture does not count as launching meanwhile (two engines that both capture would otherwise wait
    on each other). Once an engine's shapes are captured, the gate costs a lock per step."""

    def __init__(self):
        self._cond = threading.Condition()
        self._launching: dict[int, int] = {}  # thread → its nesting depth of launching()
        self._capturer: int | None = None

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            # a thread already launching goes on (a capture waiting for it must not wait on it in turn)
            self._cond.wait_for(lambda: self._capturer in (None, me) or me in self._launching)
            self._launching[me] = self._launching.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._launching[me] -= 1
                if not self._launching[me]:
                    del self._launching[me]
                self._cond.notify_all()

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            depth = self._launching.pop(me, 0)  # waiting here, this thread launches nothing
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._capturer is None)
            self._capturer = me
            self._cond.wait_for(lambda: not self._launching)
        try:
            yield
        finally:
            with self._cond:
                self._capturer = None
                if depth:
                    self._launching[me] = depth
                self._cond.notify_all()


_gate = _CaptureGate()
launching = _gate.launching
capturing = _gate.capturing


def own_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """A pool stream of `device` that no live owner holds (of either priority's 32), claimed until
    `release(stream)`: an owner gives it back as it closes. (No `weakref.finalize` fallback: at interpreter
    exit its callback on a stream still alive crashed the process, H200, 2026-11-27.)"""
    index = _index(device)
    with _lock:
        for _ in range(32):
            for priority in (0, -1):
                stream = torch.cuda.Stream(index, priority=priority)
                key = (index, stream.cuda_stream)
                if key not in _claimed:
                    _claimed.add(key)
                    return stream
    raise RuntimeError("all 64 CUDA streams of the pool are held: too many engines at once")


def release(stream: torch.cuda.Stream) -> None:
    """Give back a stream of `own_stream` (its owner is done with it)."""
    _release((stream.device.index, stream.cuda_stream))


def capture_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """The one stream every capture of `device` runs on, held for good: call it within `capturing()` (one
    capture at a time, so one stream is enough)."""
    index = _index(device)
    if index not in _capture_streams:
        _capture_streams[index] = own_stream(index)
    return _capture_streams[index]


_capture_streams: dict[int, torch.cuda.Stream] = {}


def _index(device: torch.device | int | None) -> int:
    index = torch.device("cuda", device).index if isinstance(device, int) else getattr(device, "index", None)
    return torch.cuda.current_device() if index is None else index


def _release(key: tuple[int, int]) -> None:
    with _lock:
        _claimed.discard(key)
