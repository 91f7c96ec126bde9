"""Launch shapes for the low-bit kernels, chosen by timing on the user's GPU once and kept on disk.

Why: the best tile, loop step and split-K count depend on the GPU (its processors, bandwidth and
latency) and on the layer's shape; a fixed choice leaves a third of the bandwidth unused on some
shapes. The first launch times a few candidates per distinct layer shape over the model's own layers
(so the weights come from memory, not the L2 cache), replayed as CUDA graphs as the engine runs
them; the app keeps the winners beside the engine cache, keyed by GPU, Triton and kernel version
(`TunedConfigs.file_name`). A second launch reads the file and times nothing (Triton keeps the
compiled kernels in its own cache).
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

from plugins.cuda_streams import capture_stream, capturing
from plugins.lowbit import Config, LowBitWeight, kernel_for, triton
from plugins.precompile import Case, compile_in_background, compile_now, prefill_calls, step_calls

KERNEL_VERSION = "6"  # bump when the kernels change what a config means
SPLITS = (1, 2, 4, 8, 16)
CANDIDATES = {  # per batch bucket: one row (the single chat), and 2–16 rows (timed at 8). Each distinct tile
    # and step compiles once per layer shape (about a second; the split is a value): two per shape, from
    # the winners of wider sweeps on an H100 (bench/RESULTS.md), so a first launch stays short.
    1: tuple(Config(bn, st, sk, 4, stages, kernel) for kernel, bn, st, stages in (
        ("gemv", 256, 1, 2), ("gemv", 64, 2, 3), ("packed", 64, 1, 3), ("packed", 128, 1, 3)) for sk in SPLITS),
    8: tuple(Config(64, st, sk) for st in (1, 2) for sk in SPLITS[:4]),  # 16 splits: 16 rows of partials each
}
CALLS = 24
CANDIDATES_WHAT = "low-bit kernel candidates"  # their compiles' name, which `tune_layers` waits for alone
# Configs tuned on the GPUs we measured on, by GPU model (`TunedConfigs.shipped_name`): a first launch there
# times nothing for the shapes they hold (as vLLM ships its MoE kernels' configs per GPU).
SHIPPED = Path(__file__).with_name("tuned")


def graphed_us(calls: list[Callable[[], object]], repeats: int = 10) -> float:
    """Median microseconds per call of `calls`, captured once as a CUDA graph and replayed."""
    with capturing():  # as `pipeline.cuda_graphs.CapturedCall`: an engine may be running beside the tuning
        stream = capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in calls[:3]:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for fn in calls:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.current_stream().synchronize()  # not the device's: another engine may be capturing (`plugins.cuda_streams`)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


class TunedConfigs:
    """The chosen launch shape per layer shape and batch bucket for one GPU. The caller keeps them:
    `to_json` / `from_json` (the app stores them beside the engine cache, under `file_name`)."""

    def __init__(self, say: Callable[[str], None] = lambda line: None):
        self.say = say
        self.configs: dict[str, Config] = {}
        self.changed = False

    @staticmethod
    def file_name(device: torch.device) -> str:
        gpu = torch.cuda.get_device_name(device).replace(" ", "_")
        return f"lowbit-{gpu}-triton{triton.__version__}-v{KERNEL_VERSION}.json"

    @staticmethod
    def shipped_name(gpu: str) -> str:
        """The shipped file for GPUs named `gpu`, whatever the Triton (a config runs on every version; the
        H200's were timed on Triton 3.6.0); this machine's own tuned file, where there is one, wins."""
        return f"lowbit-{gpu.replace(' ', '_')}-v{KERNEL_VERSION}.json"

    def from_json(self, text: str) -> None:
        """Adopt stored configs for the shapes not known yet; a damaged file is tuned again, not trusted."""
        try:
            self.configs = {k: Config(**v) for k, v in json.loads(text).items()} | self.configs
        except (ValueError, TypeError) as e:
            self.say(f"stored low-bit kernel configs unreadable ({type(e).__name__}); tuning again")

    def adopt_shipped(self, gpu: str) -> None:
        """Adopt the configs tuned for this GPU model in the release (`SHIPPED`) for shapes not known yet."""
        path = SHIPPED / self.shipped_name(gpu)
        if path.is_file():
            known = len(self.configs)
            self.from_json(path.read_text())
            if len(self.configs) > known:
                self.say(f"low-bit kernel configs tuned for the {gpu} in this release: "
                         f"{len(self.configs) - known} taken, not timed again")

    def to_json(self) -> str:
        return json.dumps({k: dataclasses.asdict(v) for k, v in self.configs.items()}, indent=1)


def tune_layers(weights: list[LowBitWeight], tuned: TunedConfigs) -> None:
    """Give every weight its shape's tuned configs, timing the candidates for shapes `tuned` lacks."""
    by_shape: dict[str, list[LowBitWeight]] = defaultdict(list)
    for w in weights:
        by_shape[w.shape_key()].append(w)
    missing = [(key, rows) for key in by_shape for rows in CANDIDATES if f"{key} b{rows}" not in tuned.configs]
    if missing:
        start = time.perf_counter()
        tuned.say(f"tuning the low-bit kernels for {len(by_shape)} layer shapes on this GPU (once; cached)")
        compile_candidates([(by_shape[key][0], rows) for key, rows in missing], tuned.say)
        for key, rows in tqdm(missing, desc="tuning low-bit kernels", unit="shape", file=sys.stderr):
            tuned.configs[f"{key} b{rows}"] = fastest(by_shape[key], rows)
        tuned.changed = True
        tuned.say(f"low-bit kernels tuned in {time.perf_counter() - start:.1f} s")
    for key, layers in by_shape.items():
        for w in layers:
            w.config, w.batch_config = tuned.configs[f"{key} b1"], tuned.configs[f"{key} b8"]


def compile_candidates(cases: list[tuple[LowBitWeight, int]], say: Callable[[str], None]) -> None:
    """Compile every candidate for these (layer, rows) at once on all CPU cores (Triton's
    `AsyncCompileMode`; about a second each, one after another otherwise), those compiled ahead
    (`compile_ahead`) excepted. Where this Triton lacks it, the timing loop compiles each on first use. A
    candidate that fails to compile is left to it too."""
    compile_now(candidate_cases(cases), say, CANDIDATES_WHAT)


def candidate_cases(cases: list[tuple[LowBitWeight, int]]) -> list[Case]:
    return [(layer, rows, False, config) for layer, rows in cases for config in candidates(layer, rows)]


def compile_ahead(stand_ins: list[LowBitWeight], tuned: TunedConfigs, verify: bool, device: torch.device,
                  others: list[Case] = ()) -> None:
    """Start compiling, in the background, the kernels a load will need that depend on no weights, for
    layers of these shapes (`LowBitWeight.stand_in`, one per shape; none for float weights): where `tuned`
    has a shape's configs, every variant its steps can launch (`plugins.precompile.step_calls`; `verify`:
    the engine speculates); where it lacks them, the tuning candidates and the prefill tiles (which tuning
    does not change); and `others` (the decode attention's, the sampler's, the fused ones:
    `plugins.precompile.model_calls`). `tune_layers`, `compile_steps` and `settle` wait for them. Low-bit
    layers on a GPU first take the configs the release has for this GPU model (`adopt_shipped`) for shapes
    `tuned` lacks; float weights take none (nor say so)."""
    if stand_ins and device.type == "cuda":
        tuned.adopt_shipped(torch.cuda.get_device_name(device))
    cases: list[Case] = list(others)
    missing: list[tuple[LowBitWeight, int]] = []
    for w in stand_ins:
        key = w.shape_key()
        if all(f"{key} b{rows}" in tuned.configs for rows in CANDIDATES):
            w.config, w.batch_config = tuned.configs[f"{key} b1"], tuned.configs[f"{key} b8"]
            cases += [(w, *call) for call in step_calls(w, verify)]
        else:
            missing += [(w, rows) for rows in CANDIDATES if f"{key} b{rows}" not in tuned.configs]
            cases += [(w, *call) for call in prefill_calls(w)]
    if missing:  # first in the workers' queue: tuning waits for these alone, while the others compile
        compile_in_background(candidate_cases(missing), device, CANDIDATES_WHAT)
    if cases:
        compile_in_background(cases, device, "kernels")


def candidates(layer: LowBitWeight, rows: int) -> list[Config]:
    """The candidates that run a kernel of their own on this layer (not one another candidate runs too)."""
    return [c for c in CANDIDATES[rows] if kernel_for(c, layer.bits, layer.dtype, rows) == c.kernel or rows > 1]


def fastest(layers: list[LowBitWeight], rows: int) -> Config:
    """The candidate that runs `rows` rows through `layers` (rotating through them) in the least time."""
    w0 = layers[0]
    own = torch.Generator(w0.data.device).manual_seed(0)  # not torch's default one: see `plugins.cuda_streams`
    x = torch.randn(rows, w0.in_features - w0.pad, device=w0.data.device, dtype=w0.dtype, generator=own)  # padded by the layer
    best: tuple[float, Config] | None = None
    for config in candidates(w0, rows):
        try:
            us = graphed_us([lambda i=i, config=config: layers[i % len(layers)](x, config) for i in range(CALLS)])
        except Exception:  # noqa: BLE001 - a candidate this GPU cannot compile (resources): skip it
            continue
        if best is None or us < best[0]:
            best = (us, config)
    if best is None:
        raise RuntimeError(f"no low-bit kernel configuration compiled for {w0.shape_key()}")
    return best[1]
