"""MobileSAM, ours against the official code (`mobilesam-mirror`), same weights, same run, on this machine's CPU
(or a GPU with `--device cuda`): the image encoder on a 1024×1024 input, and one click → three masks (prompt
encoder + mask decoder, as the official predictor calls them; ours through `TorchSamEngine`, as Segment runs
it). Random weights in the official `mobile_sam.pt` layout (the real file cannot be fetched here); the two
models' outputs are compared too. Median of `--repeats` runs after a warm-up, the two interleaved; prints a table, writes
mobile_sam_speed.json to $OUT.

    python bench/mobile_sam_speed.py [--device cpu] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from official_mobile_sam import official_mobile_sam  # noqa: E402
from timing import report  # noqa: E402
from pipeline.sam.engine import torch_sam_engine  # noqa: E402
from pipeline.sam.model import load_sam  # noqa: E402


def paired_ms(official, ours, device: str, repeats: int) -> tuple[float, float]:
    """Median ms of each, their runs interleaved (a busy spell of the machine hits both alike)."""
    official(), ours()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, kept in ((official, times[0]), (ours, times[1])):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            kept.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times[0]), 2), round(statistics.median(times[1]), 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    official = official_mobile_sam().build_sam_vit_t().eval().to(args.device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mobile_sam.pt"
        torch.save(official.state_dict(), path)
        ours = torch_sam_engine(load_sam(path, device=args.device))
    x = torch.randn(1, 3, 1024, 1024, device=args.device)  # a preprocessed photo (both take the same input)
    coords = torch.tensor([[[400.0, 300.0]]], device=args.device)
    labels = torch.tensor([[1]], device=args.device)
    res: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else
                 f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads",
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "repeats": args.repeats}
    with torch.inference_mode():
        theirs_embedding = official.image_encoder(x)
        our_embedding = ours.encode(x)
        res["embedding_relative_error"] = float((our_embedding - theirs_embedding).norm() / theirs_embedding.norm())
        res["encoder_official_ms"], res["encoder_ours_ms"] = paired_ms(lambda: official.image_encoder(x),
                                                                      lambda: ours.encode(x), args.device, args.repeats)

        def official_click():
            sparse, dense = official.prompt_encoder(points=(coords, labels), boxes=None, masks=None)
            return official.mask_decoder(image_embeddings=theirs_embedding, image_pe=official.prompt_encoder.get_dense_pe(),
                                         sparse_prompt_embeddings=sparse, dense_prompt_embeddings=dense,
                                         multimask_output=True)

        def our_click():
            return ours.decode(our_embedding, (coords, labels), None, None, True)

        theirs_masks, ours_masks = official_click()[0], our_click()[0]
        res["click_low_res_relative_error"] = float((ours_masks - theirs_masks).norm() / theirs_masks.norm())
        res["click_official_ms"], res["click_ours_ms"] = paired_ms(official_click, our_click, args.device, args.repeats)
    res["encoder_official_over_ours"] = round(res["encoder_official_ms"] / res["encoder_ours_ms"], 3)
    res["click_official_over_ours"] = round(res["click_official_ms"] / res["click_ours_ms"], 3)
    report("mobile_sam_speed", res)


if __name__ == "__main__":
    main()
