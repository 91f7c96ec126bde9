"""Where the int4 GEMV's time goes at batch 1 (issue 32, part 2): the kernels against a kernel that only
loads the same bytes in the same pattern, at the gate_up and down shapes, weights rotated past L2.

    python bench/gemv_probe.py time      # µs and fraction of copy bandwidth, one table
    python bench/gemv_probe.py ncu gate_up   # one call each, for `ncu` to read counters on
Writes gemv_probe.json to $OUT (time)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import copy_bandwidth_tbps, report  # noqa: E402
from pipeline.llm.weights.quant import quantize  # noqa: E402
from plugins import lowbit  # noqa: E402
from plugins.lowbit_tiles import _chunks, _row_chunk  # noqa: E402
from plugins.lowbit_tuning import graphed_us  # noqa: E402

SHAPES = {"gate_up": (3584, 37888), "down": (18944, 3584), "qkv": (3584, 4608)}
CONFIGS = [lowbit.Config(64, 1, sk, w, 3, "packed") for sk in (2, 8) for w in (2, 4)] + \
          [lowbit.Config(256, 1, sk, 4, 2, "gemv") for sk in (4, 8)]


@triton.jit
def _loads_only(w_ptr, out_ptr, N, K, SPLIT_K, BLOCK_N: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr):
    """The packed kernel's loads and loop, with one integer add per word in place of the arithmetic."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, 16)
    first, last = _chunks(pid_k, K, 4, STEPS, SPLIT_K)
    acc = tl.zeros((BLOCK_N, 16), tl.int32)
    for start in tl.range(first, last, STEPS, num_stages=STAGES):
        for i in tl.static_range(STEPS):
            c = tl.minimum(start + i, last - 1)
            acc ^= tl.load(w_ptr + _row_chunk(rn, c, K, 4)[:, None] * 16 + rw[None, :])
    tl.store(out_ptr + pid_k * N + rn, tl.sum(acc, 1), mask=rn < N)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "time"
    bandwidth = copy_bandwidth_tbps() * 1e12
    res = {"device": torch.cuda.get_device_name(), "copy_TBps": round(bandwidth / 1e12, 3), "rows": []}
    shapes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SHAPES)
    for name in shapes:
        k, n = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        parts = quantize(w, "int4", torch.bfloat16)
        stored = sum(t.nbytes for t in parts.values())
        copies = max(2, min(24, -(-(400 << 20) // stored)))
        ws = lowbit.Workspace(torch.device("cuda"))
        layers = [lowbit.LowBitWeight.from_parts({a: b.clone() for a, b in parts.items()}, 4, torch.bfloat16, None, ws)
                  for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(8 * n, dtype=torch.int32, device="cuda")
        calls = {}
        for sk in (2, 8):
            for bn, st in ((64, 1),):
                calls[f"loads-only {bn}/{st}/{sk}"] = lambda i, bn=bn, st=st, sk=sk: _loads_only[
                    (triton.cdiv(n, bn), sk)](layers[i % copies].data.view(torch.int32), out, n, k, sk, bn, st, 3)
        for c in CONFIGS:
            calls[f"{c.kernel} {c.block_n}/{c.steps}/{c.split_k}/w{c.warps}"] = lambda i, c=c: layers[i % copies](x, c)
        for label, fn in calls.items():
            if mode == "ncu":
                fn(0)
                torch.cuda.synchronize()
                continue
            us = graphed_us([lambda i=i, fn=fn: fn(i) for i in range(24)])
            res["rows"].append((name, label, round(us, 2), round(stored / (us * 1e-6) / bandwidth, 3)))
            print(f"{name:8s} {label:28s} {us:8.2f} us {stored / (us * 1e-6) / bandwidth:6.3f}", flush=True)
    if mode == "time":
        report("gemv_probe", res)


if __name__ == "__main__":
    main()
