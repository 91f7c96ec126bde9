"""Launch shapes for the low-bit kernels, chosen by timing on the user's GPU once and kept on disk.

Why: the best tile, loop step and split-K count depend on the GPU (its processors, bandwidth and
latency) and on the layer's shape; a fixed choice leaves a third of the bandwidth unused on some
shapes. The first launch times a few candidates per distinct layer shape over the model's own layers
(so the weights come from memory, not the L2 cache), replayed as CUDA graphs as the engine runs
them, and writes the winners beside the engine cache, keyed by GPU, Triton and kernel version. A
second launch reads the file and times nothing (Triton keeps the compiled kernels in its own cache).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pipeline.files import atomic_write
from plugins.lowbit import Config, LowBitWeight

KERNEL_VERSION = "1"  # bump when the kernel changes what a config means
CANDIDATES = tuple(Config(block_n=bn, steps=st, split_k=sk, warps=4, stages=3)
                   for bn in (32, 64) for st in (1, 2) for sk in (1, 2, 4, 8))
CALLS = 24


def graphed_us(calls: list[Callable[[], object]], repeats: int = 10) -> float:
    """Median microseconds per call of `calls`, captured once as a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


class TunedConfigs:
    """The chosen launch shape per layer shape for one GPU; in memory only when `folder` is None."""

    def __init__(self, folder: Path | None, device: torch.device, say: Callable[[str], None] = lambda line: None):
        import triton

        self.say = say
        gpu = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
        self.path = (Path(folder) / f"lowbit-{gpu}-triton{triton.__version__}-v{KERNEL_VERSION}.json"
                     if folder is not None else None)
        self.configs: dict[str, Config] = {}
        if self.path is not None and self.path.is_file():
            try:
                self.configs = {k: Config(**v) for k, v in json.loads(self.path.read_text()).items()}
            except (ValueError, TypeError) as e:  # a damaged file is tuned again, not trusted
                say(f"low-bit kernel configs in {self.path.name} unreadable ({type(e).__name__}); tuning again")

    def save(self) -> None:
        if self.path is not None:
            atomic_write(self.path, json.dumps({k: dataclasses.asdict(v) for k, v in self.configs.items()}, indent=1))


def tune_layers(weights: list[LowBitWeight], tuned: TunedConfigs) -> None:
    """Give every weight its shape's tuned config, timing the candidates for shapes `tuned` lacks."""
    by_shape: dict[str, list[LowBitWeight]] = defaultdict(list)
    for w in weights:
        by_shape[w.shape_key()].append(w)
    missing = [key for key in by_shape if key not in tuned.configs]
    if missing:
        start = time.perf_counter()
        tuned.say(f"tuning the low-bit kernels for {len(missing)} layer shapes on this GPU (once; cached)")
        for key in tqdm(missing, desc="tuning low-bit kernels", unit="shape", file=sys.stderr):
            tuned.configs[key] = fastest(by_shape[key])
        tuned.save()
        tuned.say(f"low-bit kernels tuned in {time.perf_counter() - start:.1f} s: " +
                  ", ".join(f"{k}: {c.block_n}/{c.steps}/{c.split_k}" for k, c in tuned.configs.items() if k in missing))
    for key, layers in by_shape.items():
        for w in layers:
            w.config = tuned.configs[key]


def fastest(layers: list[LowBitWeight]) -> Config:
    """The candidate that runs a batch-1 call over `layers` (rotating through them) in the least time."""
    w0 = layers[0]
    x = torch.randn(1, w0.in_features, device=w0.words.device, dtype=w0.dtype)
    best: tuple[float, Config] | None = None
    for config in CANDIDATES:
        try:
            us = graphed_us([lambda i=i, config=config: layers[i % len(layers)](x, config) for i in range(CALLS)])
        except Exception:  # noqa: BLE001 - a candidate this GPU cannot compile (resources): skip it
            continue
        if best is None or us < best[0]:
            best = (us, config)
    return best[1] if best else w0.config
