"""Our torch GGUF dequantizers against the `gguf` package's (numpy) on the same bytes, in the same run: the
speed that decides which types keep their own code (`pipeline/llm/weights/gguf_quants.py`), and a check
that the values agree. A 4096 × 4096 matrix of each of our types, on this machine's CPU (a GPU too where
there is one: ours run there, the package's cannot).

    python bench/gguf_dequant.py [--out bench/results/gguf_dequant.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.llm.weights.gguf_quants import DEQUANTIZE, dequantize  # noqa: E402

ROWS = COLS = 4096
SCALE_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def blocks(kind: str, rng) -> np.ndarray:
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (ROWS, COLS // per_block, nbytes), dtype=np.uint8)
    for at in SCALE_AT[kind]:  # sane float16 scales: random bytes there would be inf or NaN
        raw[..., at:at + 2] = (rng.uniform(-1, 1, raw.shape[:2]) * 1e-3).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(ROWS, -1)


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for kind in DEQUANTIZE:
        raw = blocks(kind, rng)
        qtype = GGMLQuantizationType[kind]
        theirs = best_of(lambda: reference(raw, qtype))
        tensor = torch.from_numpy(raw)
        ours = best_of(lambda: dequantize(tensor, kind, (ROWS, COLS)))
        same = torch.equal(dequantize(tensor, kind, (ROWS, COLS)),
                           torch.from_numpy(reference(raw, qtype).astype(np.float32)))
        row = {"type": kind, "gguf_ms": theirs * 1e3, "ours_cpu_ms": ours * 1e3, "ratio_cpu": theirs / ours,
               "equal": same}
        if torch.cuda.is_available():
            on_gpu = tensor.cuda()

            def gpu() -> None:
                dequantize(on_gpu, kind, (ROWS, COLS))
                torch.cuda.synchronize()

            gpu()
            row["ours_gpu_ms"] = best_of(gpu) * 1e3
        rows.append(row)
    meta = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "cores": os.cpu_count(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d"), "shape": [ROWS, COLS]}
    print(f"{'type':6} {'gguf (numpy)':>13} {'ours (CPU)':>11} {'× faster':>9} {'bitwise':>8}")
    for r in rows:
        print(f"{r['type']:6} {r['gguf_ms']:10.1f} ms {r['ours_cpu_ms']:8.1f} ms {r['ratio_cpu']:8.2f}× "
              f"{str(r['equal']):>8}")
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
