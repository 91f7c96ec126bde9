"""CUDA streams that no other live owner shares, and one CUDA graph capture at a time.

`torch.cuda.Stream()` hands out streams from a pool of 32 per priority, round-robin, so after 32 requests
two owners hold the same stream: an engine's thread then replayed its graphs on the very stream another
engine's thread was capturing on ("Cannot prepare for replay during capturing stage", and captures
invalidated: a speculating engine measuring its steps while a plain one decoded, H200, 2026-11-27). Each
engine takes its stream here (`own_stream`: one no live owner holds, given back as the engine closes), and
every capture runs on the one `capture_stream`, in thread-local mode, one at a time (`capturing`).

Engines run on threads of their own and capture as they start (a chat's step table) or at first use of a shape
(SAM, MiniGPT-4), so a capture runs while other engines serve. A probe on an H200 (2026-11-30, torch 2.11, a
thread-local capture of 150 matmul steps repeated beside another thread's work) found what that other work may do:
launch kernels on its own stream or the default one, allocate (fresh `cudaMalloc`s of 1.2 GB included), empty
torch's cache, synchronise its stream or an event, time with events, copy from pinned memory, compile and load
a Triton kernel, and run SDPA; every capture replayed right. Two things broke it, and the app does neither
while it serves (`tests/test_cuda_streams.py` reads the sources for them):
- a synchronize of the whole device (torch's `cuda.synchronize()`) in any thread invalidates the capture
  ("operation not permitted when stream is capturing"): wait on a stream or an event instead;
- a draw from torch's default CUDA generator in another thread fails while a capture runs ("Offset increment
  outside graph capture"): random numbers on the GPU come from a generator of the caller's own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_claimed: set[tuple[int, int]] = set()  # (device, stream handle) held by a live owner
_lock = threading.Lock()


_capture_lock = threading.Lock()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """One CUDA graph capture at a time in the process: every capture runs on the one `capture_stream`, and
    each registers torch's default CUDA generator, which two captures at once would both claim. Other threads'
    GPU work goes on meanwhile; no gate on it (see the module's note on what it must not do)."""
    with _capture_lock:
        yield


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
