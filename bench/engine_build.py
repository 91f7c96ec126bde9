"""Engines at real shapes (random weights), through the same factory the app uses.

For SAM ViT-B, SAM ViT-H and MiniGPT-4's vision side (EVA ViT-g + Q-Former + projection): the
first launch (ONNX export + ONNX Runtime build, weights hashed), the second launch (fingerprint
memo + engine checksums + load), the engine against torch float32 on the GPU (relative error), and
one encode on the CPU with ONNX Runtime against torch eager on the same CPU (the `auto` choice
where there is no GPU). Both run float32 on the CPU, so the relative error is the export's and the
runtime's alone. Weights: the modules' own initialisation (relative positions N(0, 0.02), as in
bench/sam_speed.py); larger random weights make a 32-layer ViT chaotic, amplifying any rounding.
Prints a table; writes engine_build_<cases>.json to $OUT.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import report  # noqa: E402
from engine_builder.build import EngineOptions  # noqa: E402
from studio.startup_report import StartupReport  # noqa: E402
from engine_builder.cache import EngineCache  # noqa: E402
from studio.backends import sam_engine, vision_encoder  # noqa: E402
from pipeline.minigpt4.engine import TorchVisionEncoder  # noqa: E402
from pipeline.minigpt4.vision import MiniGPT4Vision, VisionConfig  # noqa: E402
from pipeline.sam.engine import TorchSamEngine  # noqa: E402
from pipeline.sam.model import VARIANTS, Sam, load_sam  # noqa: E402
from pipeline.weights_io import write_weight_file  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max())


def median_s(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def launches(make, tmp: Path) -> tuple[object, float, float]:
    """(engine, first launch s, second launch s) for `make(options)` on a fresh engine folder."""
    start = time.perf_counter()
    make(EngineOptions(EngineCache(tmp / "engines"), StartupReport()))
    first = time.perf_counter() - start
    start = time.perf_counter()
    engine = make(EngineOptions(EngineCache(tmp / "engines"), StartupReport()))
    return engine, first, time.perf_counter() - start


def sam_case(variant: str, tmp: Path, res: dict, cpu_runs: int) -> None:
    path = tmp / f"sam_{variant}.pth"
    torch.manual_seed(0)
    model = Sam(VARIANTS[variant])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "rel_pos" in name:
                p.normal_(0, 0.02)
    write_weight_file(path, model.state_dict())
    sam = load_sam(path)  # CPU float32: what the exporter takes, and the reference
    engine, first, second = launches(lambda options: sam_engine(sam, "onnxruntime", path, options), tmp)
    reference = TorchSamEngine(sam)
    pixels = torch.randn(1, 3, 1024, 1024, generator=torch.Generator().manual_seed(0))
    embedding = reference.encode(pixels)
    points = (torch.tensor([[[300.0, 400.0], [650.0, 220.0]]]), torch.tensor([[1, 0]]))
    box = torch.tensor([[100.0, 120.0, 800.0, 900.0]])
    ours, theirs = (e.decode(embedding, points, box, None, True) for e in (engine, reference))
    ort_s = median_s(lambda: engine.encode(pixels), cpu_runs)
    torch_s = median_s(lambda: reference.encode(pixels), cpu_runs)
    res.update({
        f"sam_{variant} first launch s (export+build)": round(first, 1),
        f"sam_{variant} second launch s (cache)": round(second, 2),
        f"sam_{variant} encoder rel err vs torch fp32": f"{rel(engine.encode(pixels), embedding):.1e}",
        f"sam_{variant} decoder rel err vs torch fp32": f"{max(rel(ours[0], theirs[0]), rel(ours[1], theirs[1])):.1e}",
        f"sam_{variant} CPU encode s: onnxruntime": round(ort_s, 2),
        f"sam_{variant} CPU encode s: torch eager": round(torch_s, 2),
        f"sam_{variant} CPU encode: onnxruntime / torch": round(ort_s / torch_s, 2),
    })


def minigpt4_case(tmp: Path, res: dict) -> None:
    torch.manual_seed(0)
    model = MiniGPT4Vision(VisionConfig()).eval()
    path = tmp / "minigpt4_vision.pth"
    write_weight_file(path, model.state_dict())
    encoder, first, second = launches(lambda options: vision_encoder(model, "onnxruntime", [path], options), tmp)
    pixels = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    reference = TorchVisionEncoder(model)
    ort_s = median_s(lambda: encoder.encode(pixels), 3)
    torch_s = median_s(lambda: reference.encode(pixels), 3)
    res.update({"minigpt4_vision first launch s (export+build)": round(first, 1),
                "minigpt4_vision second launch s (cache)": round(second, 2),
                "minigpt4_vision rel err vs torch fp32": f"{rel(encoder.encode(pixels), reference.encode(pixels)):.1e}",
                "minigpt4_vision CPU encode s: onnxruntime": round(ort_s, 2),
                "minigpt4_vision CPU encode s: torch eager": round(torch_s, 2),
                "minigpt4_vision CPU encode: onnxruntime / torch": round(ort_s / torch_s, 2)})


def main() -> None:
    cases = sys.argv[1:] or ["vit_b", "vit_h", "minigpt4"]
    res: dict = {"device": torch.cuda.get_device_name(), "cpu threads": torch.get_num_threads(),
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    import onnxruntime

    res["onnxruntime"] = onnxruntime.__version__
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            if case == "minigpt4":
                minigpt4_case(Path(tmp), res)
            else:
                sam_case(case, Path(tmp), res, cpu_runs=3 if case == "vit_b" else 1)
    report("engine_build_" + "_".join(cases), res)


if __name__ == "__main__":
    main()
