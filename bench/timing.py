"""CUDA-event timing shared by the benchmarks: warm up, then the median of several runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def cuda_ms(fn, warm: int = 3, iters: int = 20) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_tbps() -> float:
    """Device-to-device copy bandwidth (read + write), the ceiling a memory-bound decode step meets."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_ms(lambda: y.copy_(x), warm=3, iters=10)
    return 2 * x.numel() / (ms / 1e3) / 1e12


def report(name: str, res: dict) -> None:
    """Write `res` to $OUT/<name>.json (what comes back from the device) and print it as a table."""
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    print("\n".join(f"{k:36s} {v}" for k, v in res.items()))
