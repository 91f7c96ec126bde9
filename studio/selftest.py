"""Engine self-test: build every engine for the demo models, run it, compare it with the torch backend.

    python -m studio.selftest                        # TensorRT + TensorRT-LLM (needs both, and a GPU)
    python -m studio.selftest --backend onnxruntime  # ONNX Runtime (runs anywhere; CI runs it)

One line per engine: its name, the runtime, the build (or load) time, how far it is from the torch
backend on the same weights and inputs, and OK or FAIL. Exit code 0 when every line is OK. Engines
are built fresh into a temporary folder (or `--engine-dir`), so the build path itself is tested.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine_builder import trtllm
from engine_builder.build import RUNTIMES, EngineOptions, StartupReport
from engine_builder.cache import EngineCache
from engine_builder.vision_engines import SessionSamEngine, SessionVisionEncoder
from studio.backends import load_language_model, sam_engine, vision_encoder
from pipeline.llm.demo import DEMO_MODELS, demo_model_dir
from pipeline.llm.engine import Prompt
from pipeline.llm.sampling import SamplingParams
from pipeline.minigpt4.engine import TorchVisionEncoder
from pipeline.minigpt4.weights import demo_parts, load_vision_folder
from pipeline.models import cache_dir
from pipeline.sam.engine import torch_sam_engine
from pipeline.sam.model import load_sam
from pipeline.sam.weights import DEMO as SAM_DEMO
from pipeline.sam.weights import resolve_sam

# Largest relative error accepted against torch (max |a - b| / max |b|), by the engine's precision.
TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
GREEDY_TOKENS, MIN_AGREEMENT = 16, 0.75  # LLMs: share of the first greedy tokens equal to torch's


def rel_err(ours: torch.Tensor, reference: torch.Tensor) -> float:
    ours, reference = ours.float().cpu(), reference.float().cpu()
    return float((ours - reference).abs().max() / reference.abs().max().clamp(min=1e-12))


def _row(name: str, runtime: str, seconds: float | None, measure: str, ok: bool) -> tuple[str, bool]:
    """One line; `seconds` None for an engine built together with the one above it."""
    took = f"{seconds:7.1f} s" if seconds is not None else "      –  "
    return f"{name:<20} {runtime:<22} {took}   {'OK' if ok else 'FAIL':<5} {measure}", ok


def vision_rows(backend: str, device: str, dtype: torch.dtype, options: EngineOptions) -> list[tuple[str, bool]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    path = resolve_sam(SAM_DEMO, cache_dir())
    sam = load_sam(path, device=device, dtype=dtype)
    start = time.perf_counter()
    engine = sam_engine(sam, backend, path, options)
    seconds = time.perf_counter() - start
    if not isinstance(engine, SessionSamEngine):
        return [_row("sam", backend, seconds, "not built: " + options.report.lines[-1], False)]
    reference = torch_sam_engine(sam)
    limit = TOLERANCE[engine.precision]
    pixels = torch.randn(1, 3, 1024, 1024, generator=gen)
    err = rel_err(engine.encode(pixels), reference.encode(pixels))
    rows.append(_row("sam_image_encoder", f"{backend} {engine.precision}", seconds, f"rel err {err:.1e}", err <= limit))
    embedding = reference.encode(pixels)
    points = (torch.tensor([[[300.0, 400.0], [600.0, 200.0]]]), torch.tensor([[1, 0]]))
    box = torch.tensor([[100.0, 100.0, 800.0, 900.0]])
    ours = engine.decode(embedding, points, box, None, True)
    theirs = reference.decode(embedding.to(reference.device), (points[0].to(reference.device),
                              points[1].to(reference.device)), box.to(reference.device), None, True)
    err = max(rel_err(ours[0], theirs[0]), rel_err(ours[1], theirs[1]))
    rows.append(_row("sam_mask_decoder", f"{backend} {engine.precision}", None, f"rel err {err:.1e}", err <= limit))

    ckpt, vision_dir, _ = demo_parts(cache_dir())
    vision = load_vision_folder(ckpt, vision_dir, device, dtype)
    start = time.perf_counter()
    encoder = vision_encoder(vision, backend, [ckpt, vision_dir], options)
    seconds = time.perf_counter() - start
    if not isinstance(encoder, SessionVisionEncoder):
        return rows + [_row("minigpt4_vision", backend, seconds, "not built: " + options.report.lines[-1], False)]
    pixels = torch.randn(1, 3, 224, 224, generator=gen)
    err = rel_err(encoder.encode(pixels), TorchVisionEncoder(vision).encode(pixels))
    rows.append(_row("minigpt4_vision", f"{backend} {encoder.precision}", seconds, f"rel err {err:.1e}",
                     err <= TOLERANCE[encoder.precision]))
    return rows


def llm_rows(device: str, dtype: torch.dtype, options: EngineOptions) -> list[tuple[str, bool]]:
    """TensorRT-LLM engines for the three demo LLMs against the torch engine, greedy."""
    rows = []
    for name in DEMO_MODELS:
        folder = demo_model_dir(name, cache_dir())
        start = time.perf_counter()
        ours = load_language_model(folder, name, "tensorrt", device, dtype, max_context=512, max_batch=4,
                                   engines=options)
        seconds = time.perf_counter() - start
        if "TensorRT-LLM" not in ours.description:
            rows.append(_row(name, "tensorrt-llm", seconds, "not built: " + options.report.lines[-1], False))
            continue
        reference = load_language_model(folder, name, "torch", device, dtype, max_context=512, max_batch=4)
        prompt, params = Prompt(tuple(range(3, 40))), SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0)
        got = list(ours.engine.submit(prompt, params, set()))
        want = list(reference.engine.submit(prompt, params, set()))
        agree = sum(a == b for a, b in zip(got, want)) / GREEDY_TOKENS
        rows.append(_row(name, "tensorrt-llm", seconds, f"greedy agreement {agree:.2f}", agree >= MIN_AGREEMENT))
        ours.engine.close()
        reference.engine.close()
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
        options = EngineOptions(EngineCache(args.engine_dir or Path(tmp), rebuild=True), StartupReport(echo=False))
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
