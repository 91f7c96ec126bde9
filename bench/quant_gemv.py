"""Low-bit GEMV/GEMM kernels at Qwen2.5-7B's shapes, batch 1 and 8: ours against cuBLAS bf16, gemlite and tinygemm.

Every kernel is timed in the same run, replayed as a CUDA graph of CALLS calls that walk through
enough copies of the weights to rotate past the L2 cache (each call reads its weights from memory,
as a decode step does). Per shape and batch: microseconds, the fraction of copy bandwidth the weight
bytes reach, and the error against the dequantizing reference. Ours is swept over the launch
configurations the app tunes among (`plugins.lowbit_tuning.CANDIDATES`); the best per shape and batch
is reported with its config (rows per program, chunks per step, split-K, warps).

    python bench/quant_gemv.py [--wide]  # on a CUDA GPU (gemlite optional: carried as a wheel)
Prints a table last; writes quant_gemv.json to $OUT.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import copy_bandwidth_tbps, report  # noqa: E402
from pipeline.llm.weights.quant import dequantize, quantize  # noqa: E402
from plugins import lowbit  # noqa: E402
from plugins.lowbit_tuning import CANDIDATES, graphed_us  # noqa: E402

SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584),
          "lm_head": (3584, 152064)}
BATCHES = (1, 8)
CALLS = 24
ROTATE_BYTES = 400 << 20  # weights walked per graph: far past the 50-60 MB L2
WIDE = tuple(lowbit.Config(bn, st, sk, w, sg, "packed") for bn in (32, 64, 128) for st in (1, 2) for sg in (3, 4)
             for w in (2, 4) for sk in (2, 4, 8, 16)) + \
    tuple(lowbit.Config(bn, st, sk, 4, sg, "gemv") for bn, st, sg in ((256, 1, 2), (64, 2, 3)) for sk in (4, 8, 16))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(((a.float() - b.float()).norm() / b.float().norm()).item(), 5)


def copies_for(nbytes: int) -> int:
    return max(2, min(CALLS, -(-ROTATE_BYTES // nbytes)))


def tinygemm(parts: dict):
    """torch's built-in int4 kernel (`aten._weight_int4pack_mm`) on our int4 weights, or None where absent.
    tinygemm computes (q − 8)·s + z', so z' = (8 − zero)·s; its packer takes input 2i in the high nibble
    (checked against the reference on the H100, 2026-11-23: the other order is 1.4 off)."""
    q = torch.stack((parts["q"] & 15, parts["q"] >> 4), -1).flatten(-2)  # [out, in] values 0..15
    s, z = parts["scale"], parts["zero"]
    scale_zero = torch.stack((s, (8 - z.float()) * s.float()), -1).to(torch.bfloat16).transpose(0, 1).contiguous()
    try:
        w = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous(), 8)
    except Exception:  # noqa: BLE001 - not built into this torch
        return None
    return lambda x: torch.ops.aten._weight_int4pack_mm(x, w, 128, scale_zero)


def gemlite_layer(parts: dict, mode: str, n_in: int):
    try:
        import gemlite
        import gemlite.helper as gh
    except ImportError:
        return None
    gemlite.set_native_atomic_bfp16(False)
    if mode == "int8":
        return gh.A16W8(device="cuda", dtype=torch.bfloat16).from_weights(parts["q"], scales=parts["scale"])
    q = torch.stack((parts["q"] & 15, parts["q"] >> 4), -1).flatten(-2)
    return gh.A16Wn(device="cuda", dtype=torch.bfloat16).from_weights(q, parts["scale"], parts["zero"], W_nbits=4,
                                                                       group_size=128)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--modes", default="int8,int4")
    parser.add_argument("--wide", action="store_true", help="one row: sweep the CUDA-core kernels' launch shapes "
                        "widely (rows per program, chunks per step, pipeline depth, warps), not only the app's candidates")
    args = parser.parse_args()
    one_row = WIDE if args.wide else CANDIDATES[1]
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth_tbps() * 1e12
    res: dict = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                 "triton": __import__("triton").__version__, "copy_TBps": round(bandwidth / 1e12, 3)}
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, best, sweep = [], {}, []
    for name in args.shapes.split(","):
        n_in, n_out = SHAPES[name]
        weight = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        bf16_copies = [weight] + [weight.clone() for _ in range(copies_for(weight.nbytes) - 1)]
        for batch in batches:
            x = torch.randn(batch, n_in, device="cuda", dtype=torch.bfloat16, generator=g)
            us = graphed_us([lambda w=bf16_copies[i % len(bf16_copies)]: F.linear(x, w) for i in range(CALLS)])
            rows.append((name, batch, "bf16 cuBLAS", round(us, 1), round(weight.nbytes / (us * 1e-6) / bandwidth, 3), 0.0))
        for mode in args.modes.split(","):
            parts = quantize(weight, mode, torch.bfloat16)
            stored = sum(t.nbytes for t in parts.values())
            reference_w = dequantize(parts, mode).to(torch.bfloat16)
            n_copies = copies_for(stored)
            bits = 4 if mode == "int4" else 8
            workspace = lowbit.Workspace(torch.device("cuda"))
            ours = [lowbit.LowBitWeight.from_parts({k: v.clone() for k, v in parts.items()}, bits, torch.bfloat16, None,
                                                   workspace) for _ in range(n_copies)]
            others = {}
            layer = gemlite_layer(parts, mode, n_in)
            if layer is not None:
                others["gemlite"] = [layer] + [gemlite_layer(parts, mode, n_in) for _ in range(min(n_copies, 8) - 1)]
            if mode == "int4" and (fn := tinygemm(parts)) is not None:
                others["tinygemm"] = [fn]
            for batch in batches:
                x = torch.randn(batch, n_in, device="cuda", dtype=torch.bfloat16, generator=g)
                expected = F.linear(x, reference_w).float()
                for label, fns in others.items():
                    try:
                        err = rel(fns[0](x), expected)
                        us = graphed_us([lambda f=fns[i % len(fns)]: f(x) for i in range(CALLS)])
                    except Exception as e:  # noqa: BLE001 - a library kernel that does not take this shape
                        rows.append((name, batch, f"{mode} {label}", None, None, type(e).__name__))
                        continue
                    if err > 0.05:
                        rows.append((name, batch, f"{mode} {label}", None, None, f"wrong ({err})"))
                        continue
                    rows.append((name, batch, f"{mode} {label}", round(us, 1),
                                 round(stored / (us * 1e-6) / bandwidth, 3), err))
                fastest: dict[str, tuple] = {}  # per kernel of ours ("mma", "gemv", "packed"): the best config
                for config in one_row if batch == 1 else CANDIDATES[8]:
                    if config.kernel == "packed" and mode != "int4":
                        continue  # int4 only
                    def call(i, config=config):
                        return ours[i % len(ours)](x, config)
                    try:
                        err = rel(call(0), expected)
                        us = graphed_us([lambda i=i: call(i) for i in range(CALLS)])
                    except Exception as e:  # noqa: BLE001 - a config Triton cannot compile (shared memory)
                        print(f"  {name} b{batch} {mode} {config}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    print(f"  {name} b{batch} {mode} {config.kernel} {config.block_n}/{config.steps}/{config.split_k}/"
                          f"w{config.warps}/s{config.stages}: {us:.1f} us")
                    sweep.append((name, batch, mode, vars(config), round(us, 2), err))
                    if config.kernel not in fastest or us < fastest[config.kernel][0]:
                        fastest[config.kernel] = (us, err, config)
                for kernel, (us, err, config) in sorted(fastest.items(), key=lambda kv: kv[1][0]):
                    best.setdefault(f"{mode} {name} b{batch}", vars(config) | {"us": round(us, 2)})
                    rows.append((name, batch, f"{mode} ours-{kernel} {config.block_n}/{config.steps}/{config.split_k}/"
                                 f"w{config.warps}", round(us, 1), round(stored / (us * 1e-6) / bandwidth, 3), err))
                print(f"{name} b{batch} {mode}: done", flush=True)
        res["rows (shape, batch, kernel, us, of copy bandwidth, rel err)"] = rows
        res["best ours"] = best
        res["sweep (shape, batch, mode, config, us, rel err)"] = sweep
        report("quant_gemv", res)  # after every shape: a run cut short keeps what it measured
    res["rows (shape, batch, kernel, us, of copy bandwidth, rel err)"] = rows
    res["best ours"] = best
    report("quant_gemv", res)
    print(f"\n{'shape':9s} {'b':>2s} {'kernel':36s} {'us':>8s} {'of bw':>6s} {'rel err':>9s}")
    for shape_name, batch, kernel_name, us, frac, err in rows:
        print(f"{shape_name:9s} {batch:2d} {kernel_name:36s} {us if us is not None else '-':>8} "
              f"{frac if frac is not None else '-':>6} {err:>9}")


if __name__ == "__main__":
    main()
