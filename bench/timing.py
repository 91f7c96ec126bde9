"""CUDA-event timing shared by the benchmarks: warm up, then the median of several runs."""

from __future__ import annotations

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
