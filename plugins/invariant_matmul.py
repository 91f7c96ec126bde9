"""A batch-invariant matrix product for float weights (Triton): each output row's numbers are the same bit
for bit however many rows are computed with it and wherever it sits among them.

Why: cuBLAS picks its algorithm by the row count (a GEMV for one row, split-K tiles for a few, large tiles
for a prompt), and each sums a row's products in its own order. So in bf16 a chat's greedy reply changes
when other chats run beside it (`bench/chunked_prefill.py`, "alone = with the other chats"). Here every
output is summed along the inputs in one order, fixed by the weight's shape alone:
- a program sums `BLOCK_K` inputs at a time into its fp32 tile with `tl.dot(..., acc)`, so the tensor cores
  add 16 inputs at a time in input order, whatever the tile sizes (the launch shape may follow the row
  count: `bench/invariant_matmul.py` checks that the shapes used give the same bits);
- split-K, where a weight has few output tiles, cuts the inputs at the same places for any row count
  (`splits`: from the weight's shape and the GPU's SM count), and `_sum_splits_kernel` adds the fp32
  partials in split order;
- the bias is added in fp32, then the sum is rounded once.

Used for every GEMM of a decoder in batch-invariant mode (`pipeline.llm.model.invariant`), with the decode
attention's fixed-size splits (`plugins.decode_attention`, `split_size`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from plugins.workspaces import workspace

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: batch-invariant mode is refused there (`unavailable`)
    triton = None

SPLIT_ALIGN = 256  # inputs per split: a multiple of this (of every BLOCK_K), so any launch shape cuts alike


@dataclasses.dataclass(frozen=True)
class Shape:
    """A launch shape: output columns and activation rows per program, inputs per step, warps, stages."""

    block_n: int
    block_m: int
    block_k: int
    warps: int
    stages: int


# by activation rows: up to 16 (decode steps, a verify step), up to 64, more (prompt chunks); past 128 rows a wide
# weight (the gate/up projection, the LM head) takes tiles of 256 rows (`WIDE`: 1.2-1.6x cuBLAS's time at 256-1,024
# rows where 128 took 1.5-1.8x, H200, `bench/results/invariant_kernels_h200_2026-11-29_candidates.json`)
SHAPES = ((16, Shape(64, 16, 64, 4, 5)), (64, Shape(128, 64, 64, 4, 4)), (None, Shape(128, 128, 64, 8, 3)))
WIDE = Shape(128, 256, 64, 8, 3)
_sm_counts: dict[int, int] = {}


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the kernel runs on `device` in `dtype`, else why not."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda":
        return "batch-invariant GEMMs need a CUDA GPU"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"batch-invariant GEMMs compute in bf16, fp16 or fp32, not {dtype}"
    return None


def shape_for(rows: int, n: int) -> Shape:
    """The launch shape for `rows` activation rows and `n` outputs (any gives the same bits)."""
    if rows > 128 and n >= 16384:
        return WIDE
    return next(shape for most, shape in SHAPES if most is None or rows <= most)


def splits(n: int, k: int, device: torch.device) -> int:
    """Programs sharing an output tile along the inputs: enough that a one-row product's tiles (the narrowest,
    `SHAPES[0]`) fill the GPU about twice, each at least 1,024 inputs long. A function of the weight's shape
    and the GPU only: a row's sums never depend on how many rows come with it."""
    if device.type == "cuda" and device.index not in _sm_counts:
        _sm_counts[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    programs = 2 * _sm_counts.get(device.index, 132)
    tiles = triton.cdiv(n, SHAPES[0][1].block_n)
    return max(1, min(triton.cdiv(programs, tiles), k // 1024, 16))


if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om, per_split,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # acc [BLOCK_N, BLOCK_M]: the weight's rows are the tensor cores' long side (a decode step has few
        # activation rows). Split: this program's fp32 sums go to part[split, m, n], added by `_sum_splits_kernel`.
        pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok, m_ok = rn < N, rm < M
        first = split * per_split
        last = tl.minimum(first + per_split, K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for k0 in range(first, last, BLOCK_K):
            k_ok = k0 + rk < last
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + rm[None, :].to(tl.int64) * stride_xm + (k0 + rk)[:, None],
                        mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(w.to(DOT), x.to(DOT), acc, input_precision=PRECISION)
        if SPLIT:
            tl.store(part_ptr + (split * M + rm[None, :]).to(tl.int64) * N + rn[:, None], acc,
                     mask=n_ok[:, None] & m_ok[None, :])
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=n_ok[:, None] & m_ok[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr):
        # one program per (row, BLOCK outputs): the splits' partials added in split order, then the bias
        m, rn = tl.program_id(1), tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rn < N
        acc = tl.zeros((BLOCK,), tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + rn, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m.to(tl.int64) * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if triton else {}


def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, shape: Shape | None = None) -> Tensor:
    """x [..., K] @ weight [N, K]ᵀ (+ bias) in x's dtype, each row's sums in an order fixed by the weight's
    shape (see the module docstring). `shape`: a launch shape other than the row count's (the bench's check)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    shape = shape or shape_for(m, n)
    split = splits(n, k, x.device)
    per_split = triton.cdiv(triton.cdiv(k, split), SPLIT_ALIGN) * SPLIT_ALIGN
    split = triton.cdiv(k, per_split)
    part = workspace(x.device, split * m * n) if split > 1 else out
    dot = _TL_DTYPES[x.dtype]
    has_bias = bias is not None
    _matmul_kernel[(triton.cdiv(n, shape.block_n), triton.cdiv(m, shape.block_m), split)](
        rows, weight, bias if has_bias else out, out, part, m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
        per_split, HAS_BIAS=has_bias, SPLIT=split > 1, DOT=dot, PRECISION="ieee" if dot == tl.float32 else "tf32",
        BLOCK_N=shape.block_n, BLOCK_M=shape.block_m, BLOCK_K=shape.block_k, num_warps=shape.warps,
        num_stages=shape.stages)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(n, 1024), m)](part, bias if has_bias else out, out, m, n, out.stride(0),
                                                     SPLITS=split, HAS_BIAS=has_bias, BLOCK=1024, num_warps=4)
    return out.view(*x.shape[:-1], n)
