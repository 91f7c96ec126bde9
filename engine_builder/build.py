"""Building, or loading from the cache, the engines of one network on one runtime, with progress.

Each runtime that turns ONNX graphs into engines (ONNX Runtime, TensorRT) is one `Runtime` entry;
`build_engines` exports a graph only when its engine is missing or stale (never after a failed build
of the same key), shows a progress bar in the terminal while it builds, checks a new engine against
torch on probe inputs (`engine_check`), and reports one line per engine ("built in 4.1 s, verified
(…)" or "loaded from cache in 0.02 s, verified (…)") that the terminal and the UI's start-up status
both show; a refused engine is reported with the check and its numbers, and the tool runs on torch.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from tqdm import tqdm

from engine_builder import onnxruntime_backend, tensorrt_backend
from engine_builder.cache import EngineBuildError, EngineCache, EngineKey, Verdict
from engine_builder.engine_check import check_engine
from engine_builder.fingerprint import fingerprint
from engine_builder.onnx_export import GraphSpec, export_onnx
from pipeline.engine_session import Session


@dataclasses.dataclass(frozen=True)
class Runtime:
    name: str
    unavailable: Callable[[], str | None]  # None when it can run here, else why not
    version: Callable[[], str]
    device_name: Callable[[], str]
    precision: Callable[[str], str]  # the app's dtype → the precision its engines run in
    build: Callable[[Path, Path, GraphSpec, str], None]  # (onnx graph, engine folder, spec, precision)
    load: Callable[[Path], Session]
    typed_graphs: bool = False  # the graph carries the engine's precision (a strongly typed builder)


RUNTIMES = {
    "onnxruntime": Runtime("onnxruntime", onnxruntime_backend.unavailable, onnxruntime_backend.version,
                           onnxruntime_backend.device_name, onnxruntime_backend.precision,
                           onnxruntime_backend.build, onnxruntime_backend.OrtSession),
    "tensorrt": Runtime("tensorrt", tensorrt_backend.unavailable, tensorrt_backend.version,
                        tensorrt_backend.device_name, tensorrt_backend.precision,
                        tensorrt_backend.build, tensorrt_backend.TrtSession, typed_graphs=True),
}


class Reporter(Protocol):
    """Who hears what a build does, line by line (the composition root's start-up report): `tell` for
    what every user sees (a build's progress, a fallback), `say` for details."""

    def tell(self, line: str) -> None: ...

    def say(self, line: str) -> None: ...


@dataclasses.dataclass
class EngineOptions:
    """Where engines live and who hears about them (`--engine-dir`, `--rebuild`, the start-up report)."""

    cache: EngineCache
    report: Reporter


def engine_keys(graphs: tuple[GraphSpec, ...], sources: list[Path], runtime: Runtime, dtype: str,
                cache: EngineCache) -> list[EngineKey]:
    """The cache keys of `graphs` built by `runtime` from the weights in `sources`."""
    weights = fingerprint(sources, cache.root)
    source = ";".join(str(Path(s).resolve()) for s in sources)
    return [EngineKey(g.component, source, weights, runtime.precision(dtype), g.profile(), runtime.name,
                      runtime.version(), runtime.device_name()) for g in graphs]


def engine_status(graphs: tuple[GraphSpec, ...], sources: list[Path], runtime: str, dtype: str,
                  cache: EngineCache) -> list[str]:
    """For `--check`: per engine, whether it is cached or why a launch would build it."""
    rt = RUNTIMES[runtime]
    if (why := rt.unavailable()) is not None:
        return [f"{runtime} cannot run here: {why}"]
    return [f"{key.component}: {cache.status(key)}" for key in engine_keys(graphs, sources, rt, dtype, cache)]


def build_engines(tool: str, graphs: tuple[GraphSpec, ...], module: nn.Module, sources: list[Path], runtime: str,
                  dtype: str, options: EngineOptions) -> list[Session]:
    """The loaded engines for `graphs` of `module` (whose weights were read from `sources`)."""
    rt = RUNTIMES[runtime]
    if (why := rt.unavailable()) is not None:
        raise EngineBuildError(why)
    sessions = []
    for graph, key in zip(graphs, engine_keys(graphs, sources, rt, dtype, options.cache)):
        label = f"{tool}: {graph.component} engine ({rt.name} {key.builder_version}, {key.precision})"

        def build(folder: Path, reason: str, graph: GraphSpec = graph, key: EngineKey = key, label: str = label) -> None:
            options.report.tell(f"{label}: building ({reason})")
            with tempfile.TemporaryDirectory(prefix=key.slot() + ".onnx.", dir=options.cache.root) as tmp, \
                    tqdm(total=2, desc=graph.component, unit="step", file=sys.stderr, leave=True) as bar:
                onnx_path = Path(tmp) / "graph.onnx"
                bar.set_postfix_str("exporting ONNX")
                _quiet_exporter_logs()
                export_onnx(graph, module, onnx_path,
                            getattr(torch, key.precision) if rt.typed_graphs else torch.float32)
                bar.update()
                bar.set_postfix_str(f"building with {rt.name}")
                rt.build(onnx_path, folder, graph, key.precision)
                bar.update()

        def verify(session: Session, graph: GraphSpec = graph, key: EngineKey = key, label: str = label) -> Verdict:
            options.report.tell(f"{label}: checking it against torch on probe inputs")
            return check_engine(graph, module, session, key.precision)

        session, cached = options.cache.get(key, build, rt.load, verify)
        (options.report.tell if cached.built else options.report.say)(f"{label}: {cached.outcome()}")
        sessions.append(session)
    return sessions


def _quiet_exporter_logs() -> None:
    """The exporter logs a warning per optional torchvision op it skips; users need none of them."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
