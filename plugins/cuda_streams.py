"""CUDA streams that no other live owner shares, and the one lock every CUDA graph capture takes.

`torch.cuda.Stream()` hands out streams from a pool of 32 per priority, round-robin, so after 32 requests
two owners hold the same stream: an engine's thread then replayed its graphs on the very stream another
engine's thread was capturing on ("Cannot prepare for replay during capturing stage", and captures
invalidated: a speculating engine measuring its steps while a plain one decoded, H200, 2026-11-27). Each
engine takes its stream here (`own_stream`: one no live owner holds, given back as the engine closes), and
every capture runs on the one `capture_stream`.
"""

from __future__ import annotations

import threading
import weakref

import torch

_claimed: set[tuple[int, int]] = set()  # (device, stream handle) held by a live owner
_lock = threading.Lock()
# One capture at a time in the process. Engines run on threads of their own (a chat model, a draft model,
# SAM) and capture at first use of a shape: two captures at once shared torch's one default capture stream
# ("beginAllocateToPool: already recording to mempool_id", H200, two engines over one model). Captures run
# on `capture_stream`, which no engine holds; the lock costs nothing once the shapes are captured.
CAPTURING = threading.Lock()


def own_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """A pool stream of `device` that no live owner holds (of either priority's 32), claimed until
    `release(stream)` or until the returned object is garbage collected."""
    index = _index(device)
    with _lock:
        for _ in range(32):
            for priority in (0, -1):
                stream = torch.cuda.Stream(index, priority=priority)
                key = (index, stream.cuda_stream)
                if key not in _claimed:
                    _claimed.add(key)
                    weakref.finalize(stream, _release, key)
                    return stream
    raise RuntimeError("all 64 CUDA streams of the pool are held: too many engines at once")


def release(stream: torch.cuda.Stream) -> None:
    """Give back a stream of `own_stream` (its owner is done with it)."""
    _release((stream.device.index, stream.cuda_stream))


def capture_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """The one stream every capture of `device` runs on, held for good: call it under CAPTURING (one
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
