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
  partials in split order (for a prompt's rows one program sums its tile's splits itself, in that order:
  `Shape.walk`, no partials written and read back);
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
    from triton.runtime.errors import OutOfResources
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: batch-invariant mode is refused there (`unavailable`)
    triton = None

SPLIT_ALIGN = 256  # inputs per split: a multiple of this (of every BLOCK_K), so any launch shape cuts alike


@dataclasses.dataclass(frozen=True)
class Shape:
    """A launch shape: output columns and activation rows per program, inputs per step, warps, stages; `walk`:
    one program sums a tile's splits itself, in split order (prompt rows: no fp32 partials written and read
    back); `tma`: the tiles come by the tensor-memory accelerator (Hopper on; where the inputs fit its tiles)."""

    block_n: int
    block_m: int
    block_k: int
    warps: int
    stages: int
    walk: bool = False
    tma: bool = False


# by activation rows (up to 16: decode and verify steps; up to 128: a prompt chunk beside running chats; more: a
# prompt read alone), the launch shape for a narrow weight, then for a wide one (`WIDE_N` outputs or more: the
# gate/up projection, the LM head). Chosen by `bench/invariant_kernels.py --candidates` (H200, 2026-11-30:
# `bench/results/invariant_kernels_h200_2026-11-30_candidates.json`, `..._rows.json`); every candidate gave the same
# bits. A graphed step beside running chats is 128 rows (`ModelRunner._text_size`).
SHAPES = ((16, Shape(64, 16, 64, 4, 5), Shape(64, 16, 64, 4, 5)),
          (64, Shape(128, 64, 64, 4, 4), Shape(128, 64, 64, 4, 4)),
          (128, Shape(64, 128, 64, 4, 4, tma=True), Shape(64, 128, 64, 4, 4, tma=True)),
          (256, Shape(128, 64, 64, 4, 4, walk=True, tma=True), Shape(128, 128, 64, 8, 3, walk=True, tma=True)),
          (None, Shape(128, 256, 64, 8, 3, walk=True, tma=True), Shape(256, 128, 64, 8, 3, walk=True, tma=True)))
WIDE_N = 16384
_sm_counts: dict[int, int] = {}
_has_tma: dict[int, bool] = {}
_stages: dict[tuple, int] = {}  # (shape, dtype, device): the stages whose tiles fit its shared memory


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
    return next(wide if n >= WIDE_N else narrow for most, narrow, wide in SHAPES if most is None or rows <= most)


def fitted(shape: Shape, device: torch.device) -> Shape:
    """`shape` without TMA where the GPU has none (before Hopper): the same tiles by plain loads, the same sums."""
    if device.type == "cuda" and device.index not in _has_tma:
        _has_tma[device.index] = torch.cuda.get_device_capability(device)[0] >= 9
    return dataclasses.replace(shape, tma=shape.tma and _has_tma.get(device.index, False))


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
    def _matmul_kernel(x_ptr, w_ptr, x_desc, w_desc, bias_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn,
                       stride_om, per_split, walk, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SUMMED: tl.constexpr,
                       TMA: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # acc [BLOCK_N, BLOCK_M]: the weight's rows are the tensor cores' long side (a decode step has few
        # activation rows). The row tiles of one weight tile run side by side (program_id 0), so a weight is read
        # from memory once. A program sums `walk` splits of the inputs, each from zero, adding them in split order
        # (SUMMED), as `_sum_splits_kernel` adds the partials SPLIT programs store to part[split, m, n].
        pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok, m_ok = rn < N, rm < M
        total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for s in range(walk):
            first = (split * walk + s) * per_split
            last = tl.minimum(first + per_split, K)
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for k0 in range(first, last, BLOCK_K):
                if TMA:
                    w = w_desc.load([pid_n * BLOCK_N, k0])
                    x = x_desc.load([pid_m * BLOCK_M, k0]).T
                else:
                    k_ok = k0 + rk < last
                    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :],
                                mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    x = tl.load(x_ptr + rm[None, :].to(tl.int64) * stride_xm + (k0 + rk)[:, None],
                                mask=m_ok[None, :] & k_ok[:, None], other=0.0)
                acc = tl.dot(w.to(DOT), x.to(DOT), acc, input_precision=PRECISION)
            if SUMMED:
                total += acc
            else:
                total = acc
        if SPLIT:
            tl.store(part_ptr + (split * M + rm[None, :]).to(tl.int64) * N + rn[:, None], total,
                     mask=n_ok[:, None] & m_ok[None, :])
        else:
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None],
                     total.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])

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
    shape = fitted(shape or shape_for(m, n), x.device)
    split = splits(n, k, x.device)
    per_split = triton.cdiv(triton.cdiv(k, split), SPLIT_ALIGN) * SPLIT_ALIGN
    split = triton.cdiv(k, per_split)
    walked = shape.walk or split == 1
    part = workspace(x.device, split * m * n) if not walked else out
    dot = _TL_DTYPES[x.dtype]
    has_bias = bias is not None
    tma = shape.tma and k % shape.block_k == 0 and rows.data_ptr() % 16 == weight.data_ptr() % 16 == 0  # a tile
    # never crosses a split's end; TMA reads from 16-byte aligned addresses
    x_desc = TensorDescriptor.from_tensor(rows, [shape.block_m, shape.block_k]) if tma else None
    w_desc = TensorDescriptor.from_tensor(weight, [shape.block_n, shape.block_k]) if tma else None
    fits = (shape, x.dtype, x.device)
    stages = _stages.get(fits, shape.stages)
    while True:  # fewer stages where the tiles overflow shared memory (fp32 inputs, smaller GPUs): the same sums
        try:
            _matmul_kernel[(triton.cdiv(m, shape.block_m), triton.cdiv(n, shape.block_n), 1 if walked else split)](
                rows, weight, x_desc, w_desc, bias if has_bias else out, out, part, m, n, k, rows.stride(0),
                weight.stride(0), out.stride(0), per_split, split if walked else 1, HAS_BIAS=has_bias,
                SPLIT=not walked, SUMMED=walked and split > 1, TMA=tma, DOT=dot,
                PRECISION="ieee" if dot == tl.float32 else "tf32", BLOCK_N=shape.block_n, BLOCK_M=shape.block_m,
                BLOCK_K=shape.block_k, num_warps=shape.warps, num_stages=stages)
            break
        except OutOfResources:
            if stages == 1:
                raise
            stages -= 1
    _stages[fits] = stages
    if not walked:
        _sum_splits_kernel[(triton.cdiv(n, 1024), m)](part, bias if has_bias else out, out, m, n, out.stride(0),
                                                     SPLITS=split, HAS_BIAS=has_bias, BLOCK=1024, num_warps=4)
    return out.view(*x.shape[:-1], n)
