"""Engine self-test: build every engine for the demo models, run it, compare it with the torch backend.

    python -m studio.selftest                        # TensorRT + TensorRT-LLM (needs both, and a GPU)
    python -m studio.selftest --backend onnxruntime  # ONNX Runtime (runs anywhere; CI runs it)

One line per engine: its name, the runtime, the build (or load) time, OK or FAIL and the numbers. The
lines are the verdicts the app reaches itself on every new engine (`engine_builder.engine_check`: the
vision engines against torch on probe inputs, the LLMs' greedy tokens against the float torch engine,
with image prompts through the prompt table).
Exit code 0 when every line is OK. Engines are built fresh into a temporary folder (or
`--engine-dir`), so the build path itself is tested.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine_builder import trtllm
from engine_builder.build import RUNTIMES, EngineOptions
from studio.startup_report import StartupReport
from engine_builder.cache import EngineCache
from studio.backends import load_language_model, sam_engine, vision_encoder
from pipeline.llm.demo import DEMO_MODELS, demo_model_dir
from pipeline.minigpt4.weights import demo_parts, load_vision_folder
from pipeline.models import cache_dir
from pipeline.sam.model import load_sam
from pipeline.sam.weights import DEMO as SAM_DEMO
from pipeline.sam.weights import resolve_sam

VISION_COMPONENTS = ("sam_image_encoder", "sam_mask_decoder", "minigpt4_vision")


def _row(name: str, runtime: str, seconds: float | None, measure: str, ok: bool) -> tuple[str, bool]:
    """One line; `seconds` None for an engine built together with the one above it."""
    took = f"{seconds:7.1f} s" if seconds is not None else "      –  "
    return f"{name:<20} {runtime:<22} {took}   {'OK' if ok else 'FAIL':<5} {measure}", ok


def verdict_in(lines: list[str]) -> str | None:
    """The last verdict said in `lines`: "verified (…)" or "refused (…)"."""
    for line in reversed(lines):
        for word in ("verified (", "refused ("):
            if word in line:
                return line[line.index(word):]
    return None


def vision_rows(backend: str, device: str, dtype: torch.dtype, options: EngineOptions) -> list[tuple[str, bool]]:
    """Build SAM's and MiniGPT-4's engines; each row is the verdict the app itself reaches on a new
    engine (`engine_builder.engine_check`), read from the start-up report."""
    path = resolve_sam(SAM_DEMO, cache_dir())
    start = time.perf_counter()
    sam_engine(load_sam(path, device=device, dtype=dtype), backend, path, options)
    sam_seconds = time.perf_counter() - start
    ckpt, vision_dir, _ = demo_parts(cache_dir())
    start = time.perf_counter()
    vision_encoder(load_vision_folder(ckpt, vision_dir, device, dtype), backend, [ckpt, vision_dir], options)
    seconds = {"sam_image_encoder": sam_seconds, "sam_mask_decoder": None,
               "minigpt4_vision": time.perf_counter() - start}
    rows = []
    for component in VISION_COMPONENTS:
        verdict = verdict_in([line for line in options.report.lines if f"{component} engine" in line])
        if verdict is None:
            failed = [line for line in options.report.lines if "running on torch instead" in line]
            rows.append(_row(component, backend, seconds[component], "not built: " + (failed or ["?"])[-1], False))
            continue
        rows.append(_row(component, backend, seconds[component], verdict, verdict.startswith("verified")))
    return rows


def llm_rows(device: str, dtype: torch.dtype, options: EngineOptions) -> list[tuple[str, bool]]:
    """TensorRT-LLM engines for the three demo LLMs; each row is the verdict of the check the app runs
    on every new LLM engine (`engine_builder.engine_check.check_llm`), read from the start-up report."""
    rows = []
    for name in DEMO_MODELS:
        folder = demo_model_dir(name, cache_dir())
        start = time.perf_counter()
        said = len(options.report.lines)
        llm = load_language_model(folder, name, "tensorrt", device, dtype, max_context=512, max_batch=4,
                                  engines=options, image_queries=32)
        seconds = time.perf_counter() - start
        lines = options.report.lines[said:]
        verdict = verdict_in(lines)
        ok = verdict is not None and verdict.startswith("verified") and "TensorRT-LLM" in llm.description
        rows.append(_row(name, "tensorrt-llm", seconds, verdict or "not built: " + (lines or ["?"])[-1], ok))
        llm.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["tensorrt", "onnxruntime"], default="tensorrt")
    p.add_argument("--engine-dir", type=Path, help="where to build (default: a temporary folder)")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" and args.backend == "tensorrt" else torch.float32
    if (missing := RUNTIMES[args.backend].unavailable()) is not None:
        print(f"{args.backend} cannot run here: {missing}")
        return 1
    llm_missing = trtllm.unavailable() if args.backend == "tensorrt" else "not asked for"
    with tempfile.TemporaryDirectory(prefix="studio-selftest-") as tmp:
        options = EngineOptions(EngineCache(args.engine_dir or Path(tmp), rebuild=True), StartupReport(out=None))
        rows = vision_rows(args.backend, device, dtype, options)
        if llm_missing is None:
            rows += llm_rows(device, dtype, options)
    print(f"{'engine':<20} {'runtime':<22} {'build':>9}   {'result':<5} against torch")
    print("\n".join(text for text, _ in rows))
    if llm_missing is not None:
        print(f"TensorRT-LLM engines: not tested ({llm_missing})")
    return 0 if all(ok for _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
