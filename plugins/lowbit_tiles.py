"""The low-bit kernels' shared parts: the tiled weight layout (`plugins.lowbit.kernel_bytes`), which
chunks a program of a split covers, and the split-K epilogue (`_finish`). One module so that the
tensor-core kernel (`plugins.lowbit`) and the CUDA-core ones (`plugins.lowbit_gemv`) read the same
layout and add partial sums the same way."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the caller's reference path is used
    triton = None

GROUP = 128  # int4 inputs per group (one scale and zero), ours; a chunk is 64 bytes of a row: 128 int4 or 64 int8
GROUPS = (32, 64, 128)  # the int4 groups the kernels run: 4, 2 or 1 per chunk (32: a GGUF file's blocks, kept)
BLOCK_M = 16  # activation rows per program: tl.dot's smallest tile, so batches 1–16 cost one pass
MAX_SPLIT = 16  # programs sharing an output tile along the inputs, at most (`_finish` adds their partials)
TILE = 256  # weight rows stored together: a chunk of 256 rows is 16 KB of contiguous bytes (`kernel_bytes`)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the low-bit kernels (ours and the GGUF ones) can run on `device` in `dtype`, else why not."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda" and not INTERPRETED:
        return "the low-bit kernels need a CUDA GPU"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the low-bit kernels compute in bf16 or fp16, not {dtype}"
    return None


if triton is not None:
    @triton.jit
    def _chunk_count(K, BITS: tl.constexpr):
        """Chunks along the inputs: 64 bytes of every row, 128 int4 or 64 int8 inputs."""
        return K // (128 if BITS == 4 else 64)

    @triton.jit
    def _chunks(pid_k, K, BITS: tl.constexpr, STEPS: tl.constexpr, SPLIT_K):
        """The chunks program `pid_k` of a split covers."""
        chunks = _chunk_count(K, BITS)
        per_split = tl.cdiv(tl.cdiv(chunks, SPLIT_K), STEPS) * STEPS
        first = pid_k * per_split
        return first, tl.minimum(first + per_split, chunks)

    @triton.jit
    def _row_chunk(rn, c, K, BITS: tl.constexpr):
        """Where row `rn`'s chunk `c` starts, in 64-byte units of the tiled layout (`kernel_bytes`)."""
        return ((rn // 256) * _chunk_count(K, BITS) + c) * 256 + rn % 256

    @triton.jit
    def _rows(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
        """This program's output rows in the sums (`rv`) and in the weight (`rn`). Gated (a fused gate and
        up projection, SiLU·mul applied on the way out), rows alternate: gate row i, then up row i."""
        rv = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if GATED:
            return rv, (rv >> 1) + (rv & 1) * (N // 2)
        return rv, rv

    @triton.jit
    def _finish(acc, rv, rn, rm, n_ok, m_ok, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr, count_ptr,
                SPLIT_K, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        """acc [BLOCK_N, BLOCK_M] (fp32) → out[m, n] (+ bias; gated: SiLU(gate)·up, half the rows); split,
        only the last program to arrive writes, after adding every split's partial in split order (and
        leaves the counter at zero)."""
        arrived = SPLIT_K - 1  # unsplit: this program is the last
        if SPLIT_K > 1:
            rows = tl.arange(0, BLOCK_M)
            n_all = n_ok[:, None] & (rows[None, :] < BLOCK_M)
            tl.store(part_ptr + (pid_k * BLOCK_M + rows[None, :]) * N + rv[:, None], acc, mask=n_all)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                for k in tl.static_range(16):  # MAX_SPLIT, unrolled: the loads go out together, not one round
                    # trip after another; added in split order, so every run gives the same sum
                    acc += tl.load(part_ptr + (k * BLOCK_M + rows[None, :]) * N + rv[:, None],
                                   mask=n_all & ((rows[None, :] * 0 + k) < SPLIT_K), other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call: no fill launch
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if GATED:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1)))
            ro = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            writer = (ro < N // 2) & ((ro * 0 + arrived) == SPLIT_K - 1)
            tl.store(out_ptr + rm[None, :] * stride_om + ro[:, None],
                     (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty),
                     mask=writer[:, None] & m_ok[None, :])
        else:
            tl.store(out_ptr + rm[None, :] * stride_om + rv[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=(n_ok & ((rv * 0 + arrived) == SPLIT_K - 1))[:, None] & m_ok[None, :])
