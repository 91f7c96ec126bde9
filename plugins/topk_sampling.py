"""Top-k / top-p sampling of a decode step's logits in two Triton kernels.

Why: the reference (`pipeline.llm.engine.sampling.sample`) is about twenty torch kernels over the whole
vocabulary (penalty, temperature, a radix top-k, softmaxes, cumulative sums, a search, gathers),
which cost ~0.15 ms per token on an H100: more than a decoder layer. Here:

1. `_block_top_kernel`, one program per 4096 vocabulary entries of a row: repetition penalty and
   temperature applied as the reference applies them, then the block's best `K_MAX` entries, found
   by sorting 64-bit keys (the value's bits made order-preserving above the inverted token id, so
   ties go to the lower id, as `argmax` does).
2. `_pick_kernel`, one program per row: the best `K_MAX` of all blocks' candidates, then top-k,
   top-p, and a draw with the row's uniform number, as the reference does them.

It takes rows whose top-k is 1..`K_MAX` (the UI's default is 20) or that are greedy (temperature 0:
the best entry after the penalty); the caller keeps the reference for anything else. The token is
the reference's except where float sums in another order move a cumulative probability across the
row's uniform number (a difference of ~1e-7).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference is used
    triton = None

K_MAX = 32  # candidates kept per block and per row: rows with a larger top-k use the reference (the UI: 20)
BLOCK = 4096  # vocabulary entries per program of the first kernel


if triton is not None:
    @triton.jit
    def _key(value, token, V):
        """An int64 that orders like `value` (fp32), then by lower token id."""
        bits = value.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed-int order = float order
        return (ordered.to(tl.int64) << 32) | (V - 1 - token).to(tl.int64)

    # Sizes and the columns' stride are not specialised on (whether a value is 1 or a multiple of 16): one
    # variant per dtype serves every step (1 row, several, a model's padded vocabulary or not), compiled ahead
    # at load (`plugins.precompile.sampling_calls`), where each new shape had compiled the block kernel again
    # (5.4 s). The rows' strides are, always a multiple of 16 (`_rows_of_16`): aligned, wide loads. Unspecialised
    # they made a draw 121 µs at one row, 265 at eight, against 83 and 155 (H200, `bench/sampling_kernels.py`).
    @triton.jit(do_not_specialize=["V", "NB", "stride_c"])
    def _block_top_kernel(logits_ptr, seen_ptr, columns_ptr, cand_ptr, V, NB, stride_l, stride_s, stride_c,
                          BLOCK: tl.constexpr, K: tl.constexpr):
        row, block = tl.program_id(0), tl.program_id(1)
        token = block * BLOCK + tl.arange(0, BLOCK)
        ok = token < V
        value = tl.load(logits_ptr + row * stride_l + token, mask=ok, other=0.0).to(tl.float32)
        penalty = tl.load(columns_ptr + 4 * stride_c + row)
        seen = tl.load(seen_ptr + row * stride_s + token, mask=ok, other=0)
        value = tl.where(seen != 0, tl.where(value < 0, value * penalty, value / penalty), value)
        temperature = tl.load(columns_ptr + 1 * stride_c + row)
        value = value / tl.where(temperature > 0, temperature, 1.0)
        key = tl.where(ok, _key(value, token, V), -9223372036854775808)
        best = tl.sort(key, descending=True)
        rank = tl.arange(0, BLOCK)
        tl.store(cand_ptr + (row * NB + block) * K + rank, best, mask=rank < K)

    @triton.jit(do_not_specialize=["V", "NB", "stride_c"])
    def _pick_kernel(cand_ptr, columns_ptr, out_ptr, V, NB, stride_c, C: tl.constexpr, K: tl.constexpr):
        row = tl.program_id(0)
        rank = tl.arange(0, C)
        keys = tl.load(cand_ptr + row * NB * K + rank, mask=rank < NB * K, other=-9223372036854775808)
        best = tl.sort(keys, descending=True)  # rank r: the row's r-th best entry
        token = V - 1 - (best & 0xFFFFFFFF)
        ordered = (best >> 32).to(tl.int32)
        value = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)
        uniform = tl.load(columns_ptr + row)
        temperature = tl.load(columns_ptr + 1 * stride_c + row)
        top_k = tl.load(columns_ptr + 2 * stride_c + row)
        top_p = tl.load(columns_ptr + 3 * stride_c + row)
        e = tl.where(rank.to(tl.float32) < top_k, tl.exp(value - tl.max(value, 0)), 0.0)
        probs = e / tl.sum(e, 0)
        # top-p keeps the entries before the one that crosses it, and that one
        e = tl.where(tl.cumsum(probs, 0) - probs < top_p, e, 0.0)
        cdf = tl.cumsum(e, 0)
        pick = tl.minimum(tl.sum((cdf < uniform * tl.sum(e, 0)).to(tl.int32), 0), K - 1)
        pick = tl.where(temperature > 0, pick, 0)  # greedy: the best entry after the penalty
        tl.store(out_ptr + row, tl.sum(tl.where(rank == pick, token, 0), 0))


def _rows_of_16(x: Tensor) -> Tensor:
    """`x` [B, V] with rows a multiple of 16 elements apart (copied where they are not): the kernel's row
    strides are always of that class, so one compiled variant serves every caller."""
    if x.stride(-1) == 1 and x.stride(0) % 16 == 0:
        return x
    padded = torch.empty(x.shape[0], -(-x.shape[1] // 16) * 16, dtype=x.dtype, device=x.device)
    return padded[:, :x.shape[1]].copy_(x)


def applies(top_ks: list[int], temperatures: list[float], device: torch.device) -> bool:
    """Whether the kernels can sample these rows (each greedy, or with a top-k of 1..K_MAX)."""
    return triton is not None and device.type == "cuda" and all(
        t == 0 or 0 < k <= K_MAX for k, t in zip(top_ks, temperatures))


def sample_top_k(logits: Tensor, seen: Tensor, columns: Tensor, block: int = BLOCK, compile_only: bool = False) -> Tensor:
    """Token ids [B] (int64) from `logits` [B, V] with the repetition mask `seen` [B, V] (bool) and the
    per-row numbers `columns` [5, B] (`pipeline.llm.engine.sampling.COLUMNS`: uniform, temperature, top-k,
    top-p, penalty; float32, on the logits' device). `block`: vocabulary entries per first-kernel program
    (a power of two ≥ K_MAX; smaller in the interpreter's tests, where sorting 4096 entries takes seconds).
    `compile_only`: compile the two kernels for tensors like these (in Triton's `AsyncCompileMode`: in the
    background, `plugins.precompile.compile_now`) and launch nothing: the block kernel alone took 5.3–5.6 s
    to compile at a first launch's first sampled token (H200, 2026-11-27)."""
    rows, vocab = logits.shape
    blocks = triton.cdiv(vocab, block)
    candidates = torch.empty(rows, blocks * K_MAX, dtype=torch.int64, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logits, seen = _rows_of_16(logits), _rows_of_16(seen.view(torch.int8))
    def launch(kernel, grid):
        return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]

    launch(_block_top_kernel, (rows, blocks))(logits, seen, columns, candidates, vocab, blocks, logits.stride(0),
                                              seen.stride(0), columns.stride(0), BLOCK=block, K=K_MAX, num_warps=8)
    launch(_pick_kernel, (rows,))(candidates, columns, out, vocab, blocks, columns.stride(0),
                                  C=triton.next_power_of_2(blocks * K_MAX), K=K_MAX, num_warps=8)
    return out
