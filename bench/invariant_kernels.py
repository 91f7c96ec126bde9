"""Batch-invariant mode's kernels on the GPU: bit-for-bit checks and their cost against the default ones.

- `plugins.invariant_matmul` at Qwen2.5-7B's GEMM shapes (bf16): every row of a product of M rows (1, 3, 8,
  16, 100, 256, 1,024) equal, bit for bit, to the same row computed alone; the same under every launch shape of
  `SHAPES` (the row count and the weight's width pick one); and the time against `F.linear` (cuBLAS) at 1, 8,
  128, 136 (a graphed prompt step before 2026-11-30) and 1,024 rows, in CUDA graphs (no host time), four copies
  of the weight taking turns (no product finds its weight in L2).
- the decode attention with fixed-size splits (`split_size=INVARIANT_SPLIT`): a decode query's output equal
  alone, in a batch of 8, under a larger cache bucket; a prompt's queries equal whether its chunks start at
  0 or elsewhere, and each equal to its own single-query tile; the time against the default splits at 8 rows
  and at one row, per context length.

With `--candidates`, other launch shapes for a prompt's rows (`CANDIDATES`) are checked and timed as well.

    python bench/invariant_kernels.py [--candidates]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import report  # noqa: E402
from plugins.decode_attention import INVARIANT_SPLIT, decode_attention  # noqa: E402
from plugins.invariant_matmul import SHAPES, Shape, invariant_linear  # noqa: E402
from plugins.lowbit_tuning import graphed_us  # noqa: E402

GEMMS = {"wqkv": (4608, 3584), "wo": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
         "lm_head": (152064, 3584)}
HEADS, KV_HEADS, DIM = 28, 4, 128
# other launch shapes for a prompt's rows, timed and checked with `--candidates` (the row count's pick is SHAPES')
CANDIDATES = (Shape(64, 256, 64, 8, 3, tma=True), Shape(64, 256, 64, 8, 3, walk=True, tma=True),
              Shape(128, 256, 64, 8, 3, tma=True), Shape(128, 128, 64, 8, 3, tma=True),
              Shape(128, 64, 64, 4, 4, tma=True), Shape(64, 64, 64, 4, 4, tma=True),
              Shape(128, 256, 64, 8, 3, walk=True, tma=True), Shape(128, 128, 64, 8, 3, walk=True, tma=True),
              Shape(64, 256, 64, 4, 3, tma=True), Shape(64, 128, 64, 4, 4, walk=True, tma=True))
USED = tuple(dict.fromkeys(s for _, *pair in SHAPES for s in pair))  # the shapes `shape_for` picks from


def label(s: Shape) -> str:
    return f"{s.block_n}x{s.block_m}x{s.block_k}x{s.warps}x{s.stages}{'w' if s.walk else ''}{'t' if s.tma else ''}"


def equal_under(x, w, bias, s: Shape, alone) -> bool | str:
    try:
        return bool(torch.equal(invariant_linear(x, w, bias, shape=s)[::37], alone[:len(range(0, x.shape[0], 37))]))
    except Exception as e:  # noqa: BLE001 - reported
        return f"{type(e).__name__}: {str(e)[:200]}"


def timed(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None, shapes: tuple[Shape, ...]) -> dict:
    """µs per product (CUDA graphs of 12, as the engine replays its steps), ours per launch shape and cuBLAS's."""
    def per_call(product) -> float:
        return graphed_us([lambda i=i: product(weights[i % len(weights)]) for i in range(12)])

    theirs = per_call(lambda w: F.linear(x, w, bias))
    ours = per_call(lambda w: invariant_linear(x, w, bias))
    each = {}
    for s in shapes:
        try:
            each[label(s)] = round(per_call(lambda w, s=s: invariant_linear(x, w, bias, shape=s)) / theirs, 3)
        except Exception as e:  # noqa: BLE001 - a candidate this GPU or Triton cannot run is reported, not fatal
            each[label(s)] = f"{type(e).__name__}: {str(e)[:200]}"
    return {"invariant_us": round(ours, 1), "cublas_us": round(theirs, 1), "ratio": round(ours / theirs, 3),
            "ratio_per_launch_shape": each}


def gemm_checks(device: torch.device, candidates: bool) -> dict:
    res = {}
    g = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in GEMMS.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * k ** -0.5
        bias = torch.randn(n, device=device, dtype=torch.bfloat16, generator=g) if name == "wqkv" else None
        x = torch.randn(1024, k, device=device, dtype=torch.bfloat16, generator=g)
        alone = torch.cat([invariant_linear(x[i:i + 1], w, bias) for i in range(0, 1024, 37)])
        rows_equal = {m: bool(torch.equal(invariant_linear(x[:m], w, bias)[::37], alone[:len(range(0, m, 37))]))
                      for m in (3, 8, 16, 100, 256, 1024)}
        shapes = USED + (CANDIDATES if candidates else ())
        shapes_equal = {f"{label(s)} @{m}": equal_under(x[:m], w, bias, s, alone) for s in shapes
                        for m in (8, 256)}
        cublas_equal = bool(torch.equal(F.linear(x[:8], w, bias)[0], F.linear(x[:1], w, bias)[0]))
        copies = [w] + [w.clone() for _ in range(3)]  # weights rotated: a product reads its weight from memory
        times = {m: timed(x[:m], copies, bias, shapes if m > 64 else USED)
                 for m in (1, 8, 128, 136, 1024)}
        res[name] = {"rows_equal_alone": rows_equal, "launch_shapes_equal": shapes_equal,
                     "cublas_row_of_8_equals_alone": cublas_equal, "times": times}
        del w, x
    return res


def attention_checks(device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(1)
    cache_len = 40960
    k_cache = torch.randn(9, KV_HEADS, cache_len, DIM, device=device, dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(9, KV_HEADS, cache_len, DIM, device=device, dtype=torch.bfloat16, generator=g)
    q = torch.randn(8, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=g)
    lengths = torch.tensor([300, 5000, 1, 7000, 2048, 777, 4096, 6000], device=device)
    fixed = dict(split_size=INVARIANT_SPLIT)
    batch8 = decode_attention(q, k_cache, v_cache, lengths, 8192, **fixed)
    alone = torch.cat([decode_attention(q[i:i + 1], k_cache[i:i + 1], v_cache[i:i + 1], lengths[i:i + 1], 8192, **fixed)
                       for i in range(8)])
    bigger = decode_attention(q, k_cache, v_cache, lengths, 16384, **fixed)
    default8 = decode_attention(q, k_cache, v_cache, lengths, 8192)
    default1 = torch.cat([decode_attention(q[i:i + 1], k_cache[i:i + 1], v_cache[i:i + 1], lengths[i:i + 1], 8192)
                          for i in range(8)])
    # a prompt of 700 tokens in cache row 8, its queries read in chunks that start at 0 or at 5 (other tiles)
    prompt = torch.randn(700, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=g)
    plen = torch.arange(1, 701, device=device) + 1000  # 1,000 earlier tokens in the cache, then the prompt's
    row = torch.full((700,), 8, device=device)
    whole = decode_attention(prompt, k_cache, v_cache, plen, 8192, rows=row, **fixed)
    shifted = torch.cat([decode_attention(prompt[:5], k_cache, v_cache, plen[:5], 8192, rows=row[:5], **fixed),
                         decode_attention(prompt[5:], k_cache, v_cache, plen[5:], 8192, rows=row[5:], **fixed)])
    singles = torch.cat([decode_attention(prompt[i:i + 1], k_cache, v_cache, plen[i:i + 1], 8192, rows=row[i:i + 1],
                                          **fixed) for i in range(0, 700, 97)])
    res = {"decode_alone_equals_batch_of_8": bool(torch.equal(batch8, alone)),
           "decode_cache_bucket_16384_equals_8192": bool(torch.equal(batch8, bigger)),
           "default_splits_alone_equals_batch_of_8": bool(torch.equal(default8, default1)),
           "prompt_chunks_shifted_equal": bool(torch.equal(whole, shifted)),
           "prompt_queries_equal_single_query_tiles": bool(torch.equal(whole[::97], singles)),
           "fixed_vs_reference_max_abs_diff": float((batch8.float() - default8.float()).abs().max())}
    times = {}
    for length in (300, 2000, 7000, 32000):
        lens = torch.full((8,), length, device=device)
        kv_len = 32768 if length > 8192 else 8192
        row = {}
        for rows in (1, 8):
            ours = graphed_us([lambda: decode_attention(q[:rows], k_cache, v_cache, lens[:rows], kv_len, **fixed)] * 12)
            theirs = graphed_us([lambda: decode_attention(q[:rows], k_cache, v_cache, lens[:rows], kv_len)] * 12)
            row[rows] = {"fixed_us": round(ours, 1), "default_us": round(theirs, 1), "ratio": round(ours / theirs, 3)}
        times[length] = row
    res["times_per_layer"] = times
    return res


def main() -> None:
    candidates = "--candidates" in sys.argv[1:]
    device = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "gemms": gemm_checks(device, candidates), "attention": attention_checks(device)}
    report("invariant_kernels", res)
    print(f"\n{res['device']}: batch-invariant GEMMs (bf16, Qwen2.5-7B shapes)")
    print(f"{'gemm':8s} {'rows = alone':>13s} {'shapes equal':>13s} {'cuBLAS 8 = 1':>13s}   time ratio to cuBLAS at 1 / 8 / 128 / 136 / 1024 rows")
    for name, r in res["gemms"].items():
        print(f"{name:8s} {str(all(r['rows_equal_alone'].values())):>13s} {str(all(v is True for v in r['launch_shapes_equal'].values())):>13s} "
              f"{str(r['cublas_row_of_8_equals_alone']):>13s}   " + " / ".join(f"{t['ratio']:.2f}" for t in r["times"].values()))
        unequal = [k for k, v in r["launch_shapes_equal"].items() if v is not True]
        if unequal:
            print("    not equal: " + "; ".join(f"{k} {r['launch_shapes_equal'][k]}" for k in unequal))
        if candidates:
            for m in (128, 136, 1024):
                ranked = sorted(((k, v) for k, v in r["times"][m]["ratio_per_launch_shape"].items()
                                 if isinstance(v, float)), key=lambda kv: kv[1])[:4]
                print(f"    {m} rows, fastest shapes: " + ", ".join(f"{k} {v:.2f}" for k, v in ranked))
    a = res["attention"]
    print("\ndecode attention, fixed splits: " + ", ".join(f"{k} {v}" for k, v in a.items() if k != "times_per_layer"))
    for length, row in a["times_per_layer"].items():
        print(f"  {length:6d} positions: " + "  ".join(f"{rows} rows {t['fixed_us']} µs vs {t['default_us']} µs "
                                                       f"({t['ratio']:.2f}×)" for rows, t in row.items()))


if __name__ == "__main__":
    main()
