"""Weight-only int4 (grouped) and int8 (per channel) matrix products for batch 1–16 and prefill (Triton).

Why our own kernel: a quantized decode step reads every weight once, so its time is the weight bytes
over memory bandwidth, provided dequantization keeps up; on Hopper the usual way (integer unpack,
then an int→float conversion at 16 per SM per clock, per row of the batch) falls behind. So:

- **Magic-number dequantization.** A nibble OR-ed under the bits of 128.0 is the bf16 128 + q,
  exactly (fp16: 1024.0): one AND-OR per weight, no conversion instruction. int8 is stored + 128.
- **The offset and the zero point come out once per group**, from the activations' group sum:
  Σ x·(q − z)·s = (Σ x·(128 + q) − (128 + z)·Σ x)·s, in fp32.
- **Tensor cores at any batch.** The operands come from the loaded bytes by elementwise steps only
  (int4: the low nibbles dotted with the even inputs, the high nibbles with the odd ones), so Triton
  can dequantize in the tensor cores' operand layout; the activations are padded to 16 rows and a
  batch of 8 chats costs about what one does.
- **Split-K without fills or a reduction launch.** Where a layer has few output tiles (the down
  projection), several programs share a tile's inputs, write fp32 partials to a workspace, and the
  last one to arrive (an atomic counter) adds them in a fixed order and resets the counter. One
  launch, no zero-fill, deterministic sums.
- **One row (the single chat) also has a CUDA-core GEMV** (`_gemv_kernel`): at batch 1 the tensor
  cores would multiply 15 rows of padding, and the layout change into their operands costs more
  instructions than the product. Its dequantization is two instructions per weight (an AND-OR into
  an fp32 mantissa, then the FMA); the known offset and the zero point come out once per row and
  chunk. It is bound by instructions, not memory: its loads alone read at 0.97 of copy bandwidth
  (H100, 2026-11-24), the whole kernel at up to 0.63.
- Launch shapes (kernel, tile, loop step, split) are timed per GPU and layer shape
  (`plugins/lowbit_tuning.py`): whichever kernel is fastest for a shape and batch runs it.

Layouts (`kernel_bytes`): the canonical bytes of `pipeline/llm/weights/quant.py` (int8 with its sign
bit flipped), rows stored in tiles of 256 so that a program's loads are long contiguous runs (the
GEMV reached 0.97 of copy bandwidth reading this layout, 0.85 reading plain rows: H100, 2026-11-23);
`scale` [groups, out] in the model's dtype (int4; `zero` likewise) or float32 [1, out]. The file
format on disk stays the canonical one: the tiling is done at load, in a few milliseconds per layer.

On the CPU the kernel runs under Triton's interpreter in the tests (`tests/test_lowbit.py`), whose
bf16 `tl.dot` is broken (Triton 3.9): there the dot operands are widened to fp32 first (exact for
these values). Everything else is the code the GPU runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
from torch import Tensor

from plugins.fused import silu_mul_fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the caller's reference path is used
    triton = None

GROUP = 128  # int4 inputs per group (one scale and zero); a chunk is 64 bytes of a row: one group, or 64 int8
BLOCK_M = 16  # activation rows per program: tl.dot's smallest tile, so batches 1–16 cost one pass
MAX_SPLIT = 16  # programs sharing an output tile along the inputs, at most (`_finish` adds their partials)
TILE = 256  # weight rows stored together: a chunk of 256 rows is 16 KB of contiguous bytes (`kernel_bytes`)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch shape: output rows per program, chunks (64 bytes of every row) per loop step, programs
    per output tile along the inputs (split-K), Triton's warps and pipeline depth, and which kernel."""

    block_n: int = 64
    steps: int = 1
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    kernel: str = "mma"  # one row on the CUDA cores: "gemv" (`_gemv_kernel`) or "packed" (int4, bf16: `_packed_gemv_kernel`)


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

    @triton.jit
    def _lowbit_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                     M, N, K, stride_xm, stride_om, SPLIT_K,
                     BITS: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, MAGIC: tl.constexpr,
                     DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, STEPS: tl.constexpr):
        """One [BLOCK_N, BLOCK_M] tile of out, over this split's chunks of the inputs. The dot operands come
        from the stored bytes by elementwise steps only (int4: the low and the high nibbles as two
        operands, dotted with the even and the odd inputs; int8: the byte), which Triton can apply after
        loading straight into the tensor cores' operand layout."""
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rv, rn = _rows(pid_n, N, BLOCK_N, GATED)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rb = tl.arange(0, 64)  # bytes of a row per chunk
        n_ok, m_ok = rv < N, rm < M
        compute: tl.constexpr = x_ptr.dtype.element_ty
        magic_half: tl.constexpr = 0x4300 if MAGIC == 128.0 else 0x6400
        CHUNK: tl.constexpr = 128 if BITS == 4 else 64
        first, last = _chunks(pid_k, K, BITS, STEPS, SPLIT_K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        xsum_all = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(first, last, STEPS):
            for i in tl.static_range(STEPS):
                b = start + i
                ok = (rb * 0 + b) < last
                w = tl.load(w_ptr + _row_chunk(rn, b, K, BITS)[:, None] * 64 + rb[None, :],
                            mask=n_ok[:, None] & ok[None, :], other=0).to(tl.int16)  # [BLOCK_N, 64] bytes
                x_at = x_ptr + rm[None, :] * stride_xm + b * CHUNK + rb[:, None] * (CHUNK // 64)
                x_ok = m_ok[None, :] & ok[:, None]
                if BITS == 4:
                    x_even = tl.load(x_at, mask=x_ok, other=0.0)  # [64, BLOCK_M]: inputs 2i
                    x_odd = tl.load(x_at + 1, mask=x_ok, other=0.0)
                    lo = ((w & 15) | magic_half).to(compute, bitcast=True)  # MAGIC + q, exact
                    hi = ((w >> 4) | magic_half).to(compute, bitcast=True)
                    if DOT_F32:
                        lo, hi, x_even, x_odd = lo.to(tl.float32), hi.to(tl.float32), x_even.to(tl.float32), \
                            x_odd.to(tl.float32)
                    part = tl.dot(hi, x_odd, tl.dot(lo, x_even))
                    xsum = tl.sum(x_even.to(tl.float32), 0) + tl.sum(x_odd.to(tl.float32), 0)
                    sc = tl.load(scale_ptr + b * N + rn, mask=n_ok & (rn * 0 + b < last), other=0.0).to(tl.float32)
                    zp = tl.load(zero_ptr + b * N + rn, mask=n_ok & (rn * 0 + b < last), other=0.0).to(tl.float32)
                    acc += (part - (zp + MAGIC)[:, None] * xsum[None, :]) * sc[:, None]
                else:
                    x = tl.load(x_at, mask=x_ok, other=0.0)
                    u = (w & 255).to(tl.float32 if DOT_F32 else compute)  # the stored byte, q + 128: exact
                    if DOT_F32:
                        x = x.to(tl.float32)
                    acc = tl.dot(u, x, acc)
                    xsum_all += tl.sum(x.to(tl.float32), 0)
        if BITS == 8:
            sc = tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            acc = (acc - 128 * xsum_all[None, :]) * sc[:, None]
        _finish(acc, rv, rn, rm, n_ok, m_ok, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr, count_ptr,
                SPLIT_K, HAS_BIAS, GATED, BLOCK_N, BLOCK_M)


    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, SPLIT_K,
                     BITS: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, X_BF16: tl.constexpr,
                     BLOCK_N: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr):
        """One row of activations times BLOCK_N weight rows, on the CUDA cores: two instructions per weight.

        Each 32-bit word is shifted so that one byte lands on bits 15–22, the top of an fp32 mantissa;
        an AND-OR under the bits of 1.0 makes the float 1 + q·2^(p−23), exactly (p: the value's lowest
        bit there: int4's low nibble at 15, its high one at 19; int8's byte, stored as q + 128, at 15),
        and one FMA with the input pre-scaled by 2^(23−p) adds q·x plus that scaled input. What is
        known besides Σ q·x (the scaled inputs, and the zero point times the inputs) depends on the
        chunk, not the row: it is summed once per chunk and taken out per row as one number. bf16
        inputs are read in pairs (one 32-bit load, two bit operations make the fp32 values). The loop
        is software-pipelined (`STAGES`): the next chunks' loads are in flight while one is computed."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rv, rn = _rows(pid_n, N, BLOCK_N, GATED)
        rw = tl.arange(0, 16)  # the 16 words (64 bytes) of a chunk
        n_ok = rv < N
        first, last = _chunks(pid_k, K, BITS, STEPS, SPLIT_K)
        acc = tl.zeros((BLOCK_N, 16), tl.float32)
        known = tl.zeros((BLOCK_N,), tl.float32)  # per row: what acc holds besides Σ q·x·scale
        for start in tl.range(first, last, STEPS, num_stages=STAGES):
            for i in tl.static_range(STEPS):
                c = start + i
                ok = (rw * 0 + c) < last
                w = tl.load(w_ptr + _row_chunk(rn, c, K, BITS)[:, None] * 16 + rw[None, :],
                            mask=n_ok[:, None] & ok[None, :], other=0)  # [BLOCK_N, 16] int32
                t = tl.zeros((BLOCK_N, 16), tl.float32)
                scaled = tl.zeros((16,), tl.float32)  # the scaled inputs t holds besides Σ q·x
                xs = tl.zeros((16,), tl.float32)
                for j in tl.static_range(4):  # byte j of every word
                    v = w << (15 - 8 * j) if j < 2 else w >> (8 * j - 15)
                    if BITS == 4:
                        if X_BF16:  # inputs 2j and 2j + 1 of each word's eight, in one load
                            pair = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + c * 64 + rw * 4 + j, mask=ok, other=0)
                            x_lo = (pair << 16).to(tl.float32, bitcast=True)
                            x_hi = (pair & -65536).to(tl.float32, bitcast=True)
                        else:
                            x_lo = tl.load(x_ptr + c * 128 + rw * 8 + 2 * j, mask=ok, other=0.0).to(tl.float32)
                            x_hi = tl.load(x_ptr + c * 128 + rw * 8 + 2 * j + 1, mask=ok, other=0.0).to(tl.float32)
                        lo = ((v & 0x78000) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q/256
                        hi = ((v & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q/16
                        t += lo * (x_lo * 256.0)[None, :]  # two FMAs: one sum `lo·a + hi·b` was a multiply too
                        t += hi * (x_hi * 16.0)[None, :]
                        scaled += x_lo * 256.0 + x_hi * 16.0
                        xs += x_lo + x_hi
                    else:
                        x_j = tl.load(x_ptr + c * 64 + rw * 4 + j, mask=ok, other=0.0).to(tl.float32) * 256.0
                        acc += ((v & 0x7F8000) | 0x3F800000).to(tl.float32, bitcast=True) * x_j[None, :]  # 1 + u/256
                        scaled += x_j * 1.5  # u = q + 128
                if BITS == 4:
                    c_ok = n_ok & (rn * 0 + c < last)
                    sc = tl.load(scale_ptr + c * N + rn, mask=c_ok, other=0.0).to(tl.float32)
                    zp = tl.load(zero_ptr + c * N + rn, mask=c_ok, other=0.0).to(tl.float32)
                    acc += t * sc[:, None]
                    known += (tl.sum(scaled, 0) + zp * tl.sum(xs, 0)) * sc
                else:
                    known += tl.sum(scaled, 0)
        out = tl.sum(acc, 1) - known
        if BITS == 8:
            out *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        _finish(out[:, None], rv, rn, tl.arange(0, 1), n_ok, tl.arange(0, 1) < 1, pid_n, pid_k, N, bias_ptr, out_ptr,
                0, part_ptr, count_ptr, SPLIT_K, HAS_BIAS, GATED, BLOCK_N, 1)

    @triton.jit
    def _pair_fma(a, b, c, EMULATE: tl.constexpr):
        """a·b + c on the two bf16 packed in each int32, rounded once: one `fma.rn.bf16x2`. Under the
        interpreter, which runs no PTX, the same in fp32 (exact products; the sum rounded to fp32 first,
        which can differ from one rounding in the last bit)."""
        if EMULATE:
            a0, a1 = _halves(a)
            b0, b1 = _halves(b)
            c0, c1 = _halves(c)
            return _pair(a0 * b0 + c0, a1 * b1 + c1)
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _pair_sub(a, b, EMULATE: tl.constexpr):
        """a − b on packed bf16 pairs (`sub.rn.bf16x2`), as `_pair_fma`."""
        if EMULATE:
            a0, a1 = _halves(a)
            b0, b1 = _halves(b)
            return _pair(a0 - b0, a1 - b1)
        return tl.inline_asm_elementwise("sub.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _pair_add(a, b, EMULATE: tl.constexpr):
        """a + b on packed bf16 pairs (`add.rn.bf16x2`), as `_pair_fma`."""
        if EMULATE:
            a0, a1 = _halves(a)
            b0, b1 = _halves(b)
            return _pair(a0 + b0, a1 + b1)
        return tl.inline_asm_elementwise("add.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _halves(v):
        """The two bf16 packed in int32 `v` (low half first) as fp32: two bit operations."""
        return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _pair(lo, hi):
        """Two fp32 values rounded to the nearest bf16 (ties to even, as the hardware rounds) and packed
        in an int32, low first."""
        a, b = lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)
        a = ((a + 0x7FFF + ((a >> 16) & 1)) >> 16) & 0xFFFF
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return a | b

    @triton.jit
    def _bytes(a, b, SELECT: tl.constexpr, EMULATE: tl.constexpr):
        """Four bytes picked from the eight of (a, b) (a's are 0–3, b's 4–7; `SELECT`'s hex digits name
        them, lowest byte first): one `prmt.b32`."""
        if EMULATE:
            out = tl.zeros_like(a)
            for i in tl.static_range(4):
                pick: tl.constexpr = (SELECT >> (4 * i)) & 7
                word = a if pick < 4 else b
                out |= ((word >> (8 * (pick % 4))) & 255) << (8 * i)
            return out
        return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SELECT};", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _group_values(scale_ptr, zero_ptr, rs, start, last, N, STEPS: tl.constexpr):
        """Rows `rs`' scales and zero points of groups start … start + STEPS − 1, fp32 [rows, STEPS]: a
        loop step's, loaded a step ahead (loads inside the step would stall it for a memory latency). A
        group past `last` reads the last one's, with a zero scale."""
        g = start + tl.arange(0, STEPS)
        at = tl.minimum(g, last - 1)[None, :] * N + rs[:, None]
        return tl.where(g[None, :] < last, tl.load(scale_ptr + at).to(tl.float32), 0.0), tl.load(zero_ptr + at).to(tl.float32)

    @triton.jit
    def _packed_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, SPLIT_K,
                            HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr,
                            STAGES: tl.constexpr, EMULATE: tl.constexpr):
        """int4, one row of bf16 activations: two weights per instruction, on packed bf16 pairs.

        One AND-OR makes two weights of a 32-bit word into the pair (128 + q, 128 + q'), exactly
        (nibbles 4s and 4s + 16: inputs s and s + 4 of the word's eight); one `fma.rn` on pairs with
        the matching inputs (x_s, x_s+4) and −128·(x_s, x_s+4) makes (q·x_s, q'·x_s+4) rounded once
        (both products exact inside the FMA, and the offset's product cancels exactly: 128 is a power
        of two; fp16 has no such room: −1024·x overflows it); three pair additions sum a word's eight, and only that sum is widened to fp32 and
        scaled. About 2.4 instructions per weight against 5 for `_gemv_kernel` as compiled (Triton
        3.9, sm_90). The inputs' pairing and −MAGIC·x depend on the column, not the row: each thread
        makes them once for all of its rows. The zero point comes out per word from the inputs' fp32
        sum. Chunks past this split's end (the last step of an uneven split) re-read its last chunk
        with a zero scale: no masked loads. Scales and zero points come a loop step ahead."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rv, rn = _rows(pid_n, N, BLOCK_N, GATED)
        rs = tl.minimum(rn, N - 1)  # rows past the end read a real row's scale; they are never stored
        rw = tl.arange(0, 16)  # the 16 words (64 bytes) of a chunk
        first, last = _chunks(pid_k, K, 4, STEPS, SPLIT_K)
        acc = tl.zeros((BLOCK_N, 16), tl.float32)
        steps = tl.arange(0, STEPS)
        scales, zeros = _group_values(scale_ptr, zero_ptr, rs, first, last, N, STEPS)
        for start in tl.range(first, last, STEPS, num_stages=STAGES):
            sc_step, zp_step = scales, zeros
            scales, zeros = _group_values(scale_ptr, zero_ptr, rs, start + STEPS, last, N, STEPS)  # the next step's
            for i in tl.static_range(STEPS):
                c = tl.minimum(start + i, last - 1)
                w = tl.load(w_ptr + _row_chunk(rn, c, K, 4)[:, None] * 16 + rw[None, :])  # [BLOCK_N, 16] int32
                xw = x_ptr.to(tl.pointer_type(tl.int32)) + c * 64 + rw * 4  # inputs (0, 1), (2, 3), ... of each word
                xa, xb, xc, xd = tl.load(xw), tl.load(xw + 1), tl.load(xw + 2), tl.load(xw + 3)
                p0, p1 = _bytes(xa, xc, 0x5410, EMULATE), _bytes(xa, xc, 0x7632, EMULATE)  # (x0, x4), (x1, x5)
                p2, p3 = _bytes(xb, xd, 0x5410, EMULATE), _bytes(xb, xd, 0x7632, EMULATE)  # (x2, x6), (x3, x7)
                xs = _pair_add(_pair_add(xa, xb, EMULATE), _pair_add(xc, xd, EMULATE), EMULATE)  # the word's x, summed in pairs
                sc = tl.sum(tl.where(steps[None, :] == i, sc_step, 0.0), 1)
                zp = tl.sum(tl.where(steps[None, :] == i, zp_step, 0.0), 1)
                zi = tl.minimum(tl.maximum(tl.floor(zp + 0.5), 0.0), 15.0)  # a whole zero point, 0–15
                offset = _pair(zi + 128.0, zi + 128.0)[:, None]  # (128 + zi, 128 + zi), exact
                fraction = _pair(zi - zp, zi - zp)[:, None]  # what the whole zero point left out, negated
                even, odd = w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F  # bytes: inputs 0, 2, 4, 6 and 1, 3, 5, 7
                high = tl.zeros_like(w) + 0x43434343  # 0x43: the upper byte of 128.0
                t = _pair_sub(_bytes(even, high, 0x4240, EMULATE), offset, EMULATE)  # (q0 − zi, q4 − zi), exact
                t = _pair_fma(t, p0[None, :], tl.zeros_like(w), EMULATE)
                t = _pair_fma(_pair_sub(_bytes(odd, high, 0x4240, EMULATE), offset, EMULATE), p1[None, :], t, EMULATE)
                t = _pair_fma(_pair_sub(_bytes(even, high, 0x4341, EMULATE), offset, EMULATE), p2[None, :], t, EMULATE)
                t = _pair_fma(_pair_sub(_bytes(odd, high, 0x4341, EMULATE), offset, EMULATE), p3[None, :], t, EMULATE)
                lo, hi = _halves(_pair_fma(fraction, xs[None, :], t, EMULATE))
                acc += (lo + hi) * sc[:, None]
        _finish(tl.sum(acc, 1)[:, None], rv, rn, tl.arange(0, 1), rv < N, tl.arange(0, 1) < 1, pid_n, pid_k, N,
                bias_ptr, out_ptr, 0, part_ptr, count_ptr, SPLIT_K, HAS_BIAS, GATED, BLOCK_N, 1)


def available(device: torch.device, dtype: torch.dtype, bits: int, in_features: int) -> str | None:
    """None when the kernel can run a layer like this, else why not (the caller keeps its reference)."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda" and not INTERPRETED:
        return "the low-bit kernels need a CUDA GPU"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the low-bit kernels compute in bf16 or fp16, not {dtype}"
    chunk = GROUP if bits == 4 else 64
    if in_features % chunk:
        return f"input width {in_features} is not a multiple of {chunk}"
    return None


def kernel_bytes(q: Tensor, bits: int) -> Tensor:
    """The stored weight as the kernels read it, uint8 [tiles, chunks, TILE, 64]: for every chunk (64 bytes
    of a row) the TILE rows of a tile side by side, so a program's loads are long contiguous runs. Each
    row's bytes are the canonical ones (int4: input 2i in the low nibble of byte i; int8 with its sign
    bit flipped, q + 128); rows past the last tile's end are zeros."""
    q = q.contiguous().view(torch.uint8)
    q = q if bits == 4 else q ^ 0x80
    rows, width = q.shape
    tiles = -(-rows // TILE)
    padded = torch.zeros(tiles * TILE, width, dtype=torch.uint8, device=q.device)
    padded[:rows] = q
    return padded.view(tiles, TILE, width // 64, 64).transpose(1, 2).contiguous()


class Workspace:
    """Split-K partial sums and arrival counters, shared by one model's layers (its engine runs them
    one at a time on one stream). Counters start at zero once and every call leaves them at zero."""

    def __init__(self, device: torch.device):
        self.device = device
        self.partials = torch.empty(0, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)

    def reserve(self, partial_floats: int, counters: int) -> None:
        """Grow to at least these sizes (before any CUDA graph is captured: allocation is not graphable)."""
        if self.partials.numel() < partial_floats:
            self.partials = torch.empty(partial_floats, dtype=torch.float32, device=self.device)
        if self.counters.numel() < counters:
            self.counters = torch.zeros(counters, dtype=torch.int32, device=self.device)


def default_config(bits: int, out_features: int, in_features: int, rows: int, processors: int) -> Config:
    """A launch shape without tuning: enough programs to cover the GPU at batch ≤ 16; plain tiles for prefill."""
    if rows > BLOCK_M:
        return Config(block_n=64, steps=1, split_k=1)
    tiles = -(-out_features // 64)
    chunks = in_features // (GROUP if bits == 4 else 64)
    split = 1
    while tiles * split < 2 * processors and chunks // (split * 2) >= 8 and split < MAX_SPLIT:
        split *= 2
    return Config(block_n=64, steps=1, split_k=split)


def kernel_for(config: Config, bits: int, dtype: torch.dtype, rows: int) -> str:
    """The kernel `config` runs for `rows` rows: the CUDA-core ones take one row, and "packed" bf16 int4
    weights (elsewhere "gemv" runs instead)."""
    if rows > 1:
        return "mma"
    return "gemv" if config.kernel == "packed" and (bits != 4 or dtype != torch.bfloat16) else config.kernel


def lowbit_matmul(x: Tensor, data: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, bits: int,
                  config: Config, workspace: Workspace | None, gated: bool = False, compile_only: bool = False) -> Tensor:
    """x [..., in] @ the packed weight's transpose (+ bias) → [..., out] in x's dtype; gated (the weight is
    a gate projection above an up projection): SiLU(gate)·up → [..., out / 2]. `compile_only`: compile
    the kernel this call needs (in Triton's `AsyncCompileMode`, in the background) and launch nothing."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1 or x2.data_ptr() % 16:  # the kernels read the inputs in aligned pairs or more
        x2 = x2.clone(memory_format=torch.contiguous_format)
    m, k = x2.shape
    n = scale.shape[-1]  # output features (the data holds whole tiles)
    n_out = n // 2 if gated else n
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    split = config.split_k if m <= BLOCK_M else 1
    assert split <= MAX_SPLIT, config
    kernel = kernel_for(config, bits, x.dtype, m)
    gemv = kernel != "mma"
    block_m = 1 if gemv else BLOCK_M if m <= BLOCK_M else 64
    tiles = triton.cdiv(n, config.block_n)
    if split > 1:
        workspace.reserve(split * block_m * n, tiles)
        partials, counters = workspace.partials, workspace.counters
    else:
        partials = counters = out  # unused
    common = dict(BITS=bits, HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=config.block_n, STEPS=config.steps,
                  num_warps=config.warps, num_stages=config.stages)
    tensors = (x2, data.view(torch.int32) if gemv else data, scale, zero if zero is not None else scale,
               bias if bias is not None else scale, out, partials, counters)
    def launcher(kernel, grid):
        return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]

    if kernel == "packed":
        common.pop("BITS")
        launcher(_packed_gemv_kernel, (tiles, split))(*tensors, n, k, split, STAGES=config.stages,
                                                       EMULATE=INTERPRETED, **common)
    elif gemv:
        launcher(_gemv_kernel, (tiles, split))(*tensors, n, k, split, X_BF16=x.dtype == torch.bfloat16,
                                                STAGES=config.stages, **common)
    else:
        launcher(_lowbit_kernel, (tiles, split, triton.cdiv(m, block_m)))(
            *tensors, m, n, k, x2.stride(0), out.stride(0), split,  # split: a value, not compiled in
            MAGIC=128.0 if x.dtype == torch.bfloat16 else 1024.0, DOT_F32=INTERPRETED, BLOCK_M=block_m, **common)
    return out.view(*shape[:-1], n_out)


class LowBitWeight:
    """One layer's packed weight and how to launch on it: `config` for one row, `batch_config` for 2–16
    rows (the decode step; both tuned per GPU by `plugins.lowbit_tuning`), plain tiles for prefill.
    `gated`: a fused gate and up projection whose output is SiLU(gate)·up: for one row (the single
    chat's decode step) made in the kernel's last step, with no separate launch; for more rows by
    `plugins.fused`'s SiLU·mul kernel after the plain product, which measured faster there."""

    def __init__(self, data: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, bits: int,
                 dtype: torch.dtype, workspace: Workspace, gated: bool = False):
        self.data, self.scale, self.zero, self.bias, self.bits, self.dtype = data, scale, zero, bias, bits, dtype
        self.workspace, self.gated = workspace, gated
        self.out_features = scale.shape[-1]
        self.in_features = data.shape[1] * 64 * 8 // bits
        processors = torch.cuda.get_device_properties(data.device).multi_processor_count if data.is_cuda else 132
        self.config = default_config(bits, self.out_features, self.in_features, 1, processors)
        self.batch_config = default_config(bits, self.out_features, self.in_features, 8, processors)
        self.prefill = default_config(bits, self.out_features, self.in_features, BLOCK_M + 1, processors)

    @classmethod
    def from_parts(cls, parts: dict[str, Tensor], bits: int, dtype: torch.dtype, bias: Tensor | None,
                   workspace: Workspace, gated: bool = False) -> "LowBitWeight":
        """From the canonical format's tensors (`pipeline.llm.weights.quant.quantize`: q, scale[, zero])."""
        if bits == 4:
            scale, zero = parts["scale"].t().contiguous(), parts["zero"].t().contiguous()
        else:
            scale, zero = parts["scale"].view(1, -1).contiguous(), None
        return cls(kernel_bytes(parts["q"], bits), scale, zero, bias, bits, dtype, workspace, gated)

    def shape_key(self) -> str:
        """What a tuned launch shape is chosen for (layers alike in this run alike)."""
        extras = (" +bias" if self.bias is not None else "") + (" +silu_mul" if self.gated else "")
        return f"int{self.bits} {self.in_features}->{self.out_features}{extras}"

    def __call__(self, x: Tensor, config: Config | None = None, compile_only: bool = False) -> Tensor:
        rows = x.numel() // x.shape[-1]
        chosen = config or (self.config if rows == 1 else self.batch_config if rows <= BLOCK_M else self.prefill)
        in_kernel = self.gated and rows == 1  # more rows: the gated tile was slower (int4 prefill 1.3×, H100)
        out = lowbit_matmul(x, self.data, self.scale, self.zero, self.bias, self.bits, chosen, self.workspace,
                            in_kernel, compile_only)
        return silu_mul_fused(out) if self.gated and not in_kernel and not compile_only else out
