"""Which gemlite kernel to run for a batch-1 decode step: each int8/int4 variant against cuBLAS bf16, in one run.

The H100 run of `bench/llm_quant.py` (2026-11-23) found gemlite's int8 GEMVs at 0.84 of the copy
bandwidth but its int4 GEMV (auto choice: GEMV_REVSPLITK) at 0.57, so int4 decode was only 1.60× bf16.
This times, at Qwen2.5-7B's projection shapes and its LM head, every batch-1 kernel gemlite offers
(GEMV, GEMV_REVSPLITK, GEMV_SPLITK, GEMM_SPLITK), with 32- and 8-bit packing for int4 and split-K sums
added in float32 or bfloat16, each replayed as a CUDA graph of 20 calls (as the engine runs them), and
reports microseconds, the fraction of copy bandwidth the weight bytes reach, and the error against the
dequantizing reference. Prints a table; writes quant_gemv.json to $OUT.

    python bench/quant_gemv.py        # on a CUDA GPU with gemlite
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import copy_bandwidth_tbps, report  # noqa: E402
from pipeline.llm.quant import QuantLinear, group_size, unpack_int4  # noqa: E402

SHAPES = {"qkv 3584→4608": (3584, 4608), "o 3584→3584": (3584, 3584), "gate_up 3584→37888": (3584, 37888),
          "down 18944→3584": (18944, 3584), "lm_head 3584→152064": (3584, 152064)}
KERNELS = ("auto", "GEMV", "GEMV_REVSPLITK", "GEMV_SPLITK", "GEMM_SPLITK")
CALLS = 20


def graphed_us(fn, x: torch.Tensor) -> float:
    """Microseconds per call of `fn(x)`, replayed as one CUDA graph of CALLS calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def kernel_for(layer: QuantLinear, packing: int):
    """gemlite's layer for `layer`'s stored weights with `packing`-bit packing (int4)."""
    import gemlite.helper as gh

    if layer.mode == "int8":
        return gh.A16W8(device=layer.q.device, dtype=layer.dtype).from_weights(layer.q, scales=layer.scale)
    return gh.A16Wn(device=layer.q.device, dtype=layer.dtype, packing_bitwidth=packing).from_weights(
        unpack_int4(layer.q), layer.scale, layer.zero, W_nbits=4, group_size=group_size(layer.in_features))


def main() -> None:
    import gemlite

    bandwidth = copy_bandwidth_tbps() * 1e12
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gemlite": gemlite.__version__,
                 "date": time.strftime("%Y-%m-%d"), "copy_TBps": round(bandwidth / 1e12, 3)}
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape_name, (n_in, n_out) in SHAPES.items():
        linear = torch.nn.Linear(n_in, n_out, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.normal_(0, 0.02, generator=g)
        x = torch.randn(1, n_in, device="cuda", dtype=torch.bfloat16, generator=g)
        us = graphed_us(lambda v: F.linear(v, linear.weight), x)
        rows.append((shape_name, "bf16 cuBLAS", round(us, 1), round(linear.weight.nbytes / (us * 1e-6) / bandwidth, 2),
                     0.0))
        for mode in ("int8", "int4"):
            layer = QuantLinear.from_linear(linear, mode)
            expected = F.linear(x, layer.weight_float().to(torch.bfloat16)).float()
            stored = sum(t.nbytes for t in layer.parts().values())
            for packing in ((32, 8) if mode == "int4" else (8,)):
                kernel = kernel_for(layer, packing)
                for adds in ("fp32", "bf16"):
                    gemlite.set_native_atomic_bfp16(adds == "bf16")
                    for choice in KERNELS:
                        def call(v, kernel=kernel, choice=choice):
                            return kernel(v) if choice == "auto" else kernel.forward_manual(v, choice)
                        try:
                            err = ((call(x).float() - expected).norm() / expected.norm()).item()
                            us = graphed_us(call, x)
                        except Exception as e:  # noqa: BLE001 - a kernel gemlite does not offer for this shape
                            rows.append((shape_name, f"{mode} p{packing} {adds} adds {choice}", None, None,
                                         f"{type(e).__name__}"))
                            continue
                        rows.append((shape_name, f"{mode} p{packing} {adds} adds {choice}", round(us, 1),
                                     round(stored / (us * 1e-6) / bandwidth, 2), round(err, 5)))
        gemlite.set_native_atomic_bfp16(False)
    res["rows (shape, kernel, us, of copy bandwidth, rel err)"] = rows
    report("quant_gemv", res)
    print(f"\n{'shape':22s} {'kernel':40s} {'us':>8s} {'of bw':>6s} {'rel err':>9s}")
    for shape_name, kernel_name, us, frac, err in rows:
        print(f"{shape_name:22s} {kernel_name:40s} {us if us is not None else '-':>8} "
              f"{frac if frac is not None else '-':>6} {err:>9}")


if __name__ == "__main__":
    main()
