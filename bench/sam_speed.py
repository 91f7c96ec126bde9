"""SAM ViT-H on the GPU: ours against the official segment_anything code, same weights, same run.

Random weights at the real shapes. Fidelity first (image embeddings fp32 and bf16, masks of a
click), then timings with CUDA events (median): image encoder (official fp32, official under bf16
autocast — the reference users run — and ours), and one click → masks (official prompt encoder +
mask decoder; ours eager and as a replayed CUDA graph, and ours through the whole `SegmentPipeline.predict` with upscaling
to a 1500×1000 photo and the copy back to the CPU). Prints a table; writes sam_speed.json to $OUT.
Needs the `segment-anything` wheel (pure Python) on the path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import cuda_ms  # noqa: E402
from studio.backends import sam_engine  # noqa: E402
from pipeline.sam.model import VARIANTS, Sam, load_sam  # noqa: E402
from pipeline.pipelines.segment import SegmentPipeline, SegmentStats  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))


def official_modules():
    spec = importlib.util.find_spec("segment_anything")
    package = types.ModuleType("segment_anything")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["segment_anything"] = package  # skip its __init__ (mask generator needs torchvision)
    from segment_anything import build_sam

    return build_sam


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    torch.manual_seed(0)
    official = official_modules().build_sam_vit_h().cuda().eval()
    with torch.no_grad():
        for name, p in official.named_parameters():
            if "rel_pos" in name:
                p.normal_(0, 0.02)
    state = {k: v.detach().clone() for k, v in official.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(state, Path(tmp) / "sam_vit_h.pth")
        seg = SegmentPipeline(sam_engine(load_sam(Path(tmp) / "sam_vit_h.pth", device="cuda", dtype=torch.bfloat16)))
    engine = seg.engine  # replays CUDA graphs (encoder and clicks)
    ours32 = Sam(VARIANTS["vit_h"]).cuda().eval()
    ours32.load_state_dict(state)
    x = torch.randn(1, 3, 1024, 1024, device="cuda")
    coords = torch.tensor([[[500.0, 375.0]]], device="cuda")
    labels = torch.tensor([[1]], device="cuda")

    with torch.inference_mode():
        ref = official.image_encoder(x)
        res["embed_rel_err_ours_fp32"] = round(rel(ours32.image_encoder(x), ref), 7)
        ours_bf16 = engine.model.image_encoder(x.bfloat16()).float()
        res["embed_rel_err_ours_bf16"] = round(rel(ours_bf16, ref), 5)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            res["embed_rel_err_official_bf16_autocast"] = round(rel(official.image_encoder(x).float(), ref), 5)

        def official_click(emb):
            sparse, dense = official.prompt_encoder(points=(coords, labels), boxes=None, masks=None)
            return official.mask_decoder(image_embeddings=emb, image_pe=official.prompt_encoder.get_dense_pe(),
                                         sparse_prompt_embeddings=sparse, dense_prompt_embeddings=dense,
                                         multimask_output=True)

        def ours_click(model, emb):
            return model.decode(emb, (coords, labels), None, None, True)

        low_ref, _ = official_click(ref)
        low_bf16, _ = ours_click(engine.model, ours_bf16)
        a, b = low_ref > 0, low_bf16 > 0
        res["click_mask_iou_ours_bf16_vs_official_fp32"] = round(((a & b).sum() / (a | b).sum().clamp(min=1)).item(), 4)
        res["click_logits_rel_err_ours_fp32"] = round(rel(ours_click(ours32, ref)[0], low_ref), 7)

        res["encoder_ms_official_fp32"] = round(cuda_ms(lambda: official.image_encoder(x), 2, 10), 2)

        def autocast_encoder():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                official.image_encoder(x)
        res["encoder_ms_official_bf16_autocast"] = round(cuda_ms(autocast_encoder, 2, 10), 2)
        xb = x.bfloat16()
        res["encoder_ms_ours_bf16_eager"] = round(cuda_ms(lambda: engine.model.image_encoder(xb), 2, 10), 2)
        res["encoder_graph_equals_eager"] = bool(torch.equal(engine.encode(x), engine.model.image_encoder(xb).float()))
        res["encoder_ms_ours_bf16"] = round(cuda_ms(lambda: engine.encode(x), 2, 10), 2)
        res["click_ms_official_fp32"] = round(cuda_ms(lambda: official_click(ref)), 3)
        res["click_ms_ours_fp32_eager"] = round(cuda_ms(lambda: ours_click(engine.model, ref)), 3)
        graphed = engine.decode(ref, (coords, labels), None, None, True)
        eager = ours_click(engine.model, ref)
        res["click_graph_equals_eager"] = bool(torch.equal(graphed[0], eager[0]) and torch.equal(graphed[1], eager[1]))
        res["click_ms_ours_fp32_graph"] = round(
            cuda_ms(lambda: engine.decode(ref, (coords, labels), None, None, True)), 3)
    del ours32
    photo = np.random.default_rng(0).integers(0, 255, (1000, 1500, 3), dtype=np.uint8)
    stats = SegmentStats()
    handle = seg.set_image(photo, stats)
    res["pipeline_set_image_ms_first"] = round(stats.last_encoder_ms, 1)
    res["pipeline_predict_ms_1500x1000"] = round(
        cuda_ms(lambda: seg.predict(handle, [[700, 500]], [1], stats=stats)), 3)
    res["pipeline_encoder_runs_after_clicks"] = stats.encoder_runs
    res["ratio_encoder_official_autocast_over_ours"] = round(
        res["encoder_ms_official_bf16_autocast"] / res["encoder_ms_ours_bf16"], 2)
    res["ratio_click_official_over_ours_graph"] = round(res["click_ms_official_fp32"] / res["click_ms_ours_fp32_graph"], 2)
    (OUT / "sam_speed.json").write_text(json.dumps(res, indent=1))
    print("\n".join(f"{k:45s} {v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
