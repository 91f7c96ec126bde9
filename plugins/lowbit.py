"""Weight-only int4 (grouped) and int8 (per channel) matrix products for batch 1–16 and prefill (Triton).

Why our own kernels: a quantized decode step reads every weight once, so its time is the weight
bytes over memory bandwidth, provided dequantization keeps up. On Hopper it barely does: the H200
must turn ~37 int4 weights per SM per clock into math, and the usual way (integer unpack, then an
int→float conversion at 16 per SM per clock) is capped near 0.45 of bandwidth. So:

- **Magic-number dequantization, no conversion instructions.** int4: a nibble moved under the bits
  of 128.0 is the float 128 + q (`(w >> s) & 0x000F000F | 0x43004300` gives two such bf16 lanes in
  one AND-OR; fp16 uses 1024.0). int8: the byte (stored + 128) under 2^23, or its two nibbles as lanes.
- **The offset and the zero point come out once per group**, from the activations' group sum:
  Σ x·(q − z)·s = (Σ x·(128 + q) − (128 + z)·Σ x)·s, in fp32.
- **Two kernels, chosen per shape and batch by timing (`plugins/lowbit_tuning.py`)**: `_mma_kernel`
  joins the lanes back into input order and runs one tensor-core `tl.dot` per 16-word chunk with the
  activations padded to 16 rows, so a batch of 8 costs what a batch of 1 does; `_fma_kernel` keeps
  each weight an fp32 on the CUDA cores (two integer instructions and one FMA per weight and row),
  which needs no layout change for the tensor cores, for 1–4 rows.
- **Split-K without fills or a reduction launch.** Where a layer has few output tiles (the down
  projection), several programs share a tile's inputs, write fp32 partials to a workspace, and the
  last one to arrive (an atomic counter) adds them in a fixed order and resets the counter. One
  launch, no zero-fill, deterministic sums.

Layouts (`pack_int4` / `pack_int8`): the canonical bytes of `pipeline/llm/quant.py` read as int32
words (int8 with its sign bit flipped), so nibble (byte) j of word w is input 8w + j (4w + j);
`scale` [groups, out] in the model's dtype (int4; `zero` likewise) or float32 [1, out] (int8).

On the CPU the kernels run under Triton's interpreter in the tests (`tests/test_lowbit.py`), whose
bf16 `tl.dot` is broken (Triton 3.9): there the dot operands are widened to fp32 first (exact for
these values). Everything else is the code the GPU runs.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the caller's reference path is used
    triton = None

GROUP = 128  # int4 inputs per group (one scale and zero); int8 packs 64 inputs per 16 words
BLOCK_M = 16  # activation rows per program: tl.dot's smallest tile, so batches 1–16 cost one pass
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch shape: which kernel ("mma", "mma2": tensor cores, batches 1–16 in one weight pass;
    "fma": CUDA cores, 1–4 rows), output rows per program, 16-word chunks per loop step, programs per output tile
    along the inputs (split-K), and Triton's warps and pipeline depth."""

    kind: str = "mma"
    block_n: int = 64
    steps: int = 1
    split_k: int = 1
    warps: int = 4
    stages: int = 3


if triton is not None:
    @triton.jit
    def _chunks(pid_k, K, BITS: tl.constexpr, STEPS: tl.constexpr, SPLIT_K):
        """The chunks (16 words of every row: 128 int4 or 64 int8 inputs) program `pid_k` of a split covers."""
        chunks = K // (128 if BITS == 4 else 64)
        per_split = tl.cdiv(tl.cdiv(chunks, SPLIT_K), STEPS) * STEPS
        first = pid_k * per_split
        return first, tl.minimum(first + per_split, chunks)

    @triton.jit
    def _finish(acc, rn, rm, n_ok, m_ok, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr, count_ptr,
                SPLIT_K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        """acc [BLOCK_N, BLOCK_M] (fp32) → out[m, n] (+ bias); split, only the last program to arrive
        writes, after adding every split's partial in split order (and leaves the counter at zero)."""
        writer = n_ok
        if SPLIT_K > 1:
            rows = tl.arange(0, BLOCK_M)
            n_all = n_ok[:, None] & (rows[None, :] < BLOCK_M)
            tl.store(part_ptr + (pid_k * BLOCK_M + rows[None, :]) * N + rn[:, None], acc, mask=n_all)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            writer = n_ok & ((rn * 0 + arrived) == SPLIT_K - 1)
            if arrived == SPLIT_K - 1:
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                for k in range(SPLIT_K):  # in split order: the same sum on every run
                    acc += tl.load(part_ptr + (k * BLOCK_M + rows[None, :]) * N + rn[:, None], mask=n_all, other=0.0,
                                   cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call: no fill launch
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=writer[:, None] & m_ok[None, :])

    @triton.jit
    def _lanes(t, compute: tl.constexpr):
        """An int32 tensor of two 16-bit float patterns → its low and high halves as `compute` floats."""
        return t.to(tl.int16).to(compute, bitcast=True), (t >> 16).to(tl.int16).to(compute, bitcast=True)

    @triton.jit
    def _mma_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                    M, N, K, stride_xm, stride_om, SPLIT_K,
                    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC: tl.constexpr,
                    DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, STEPS: tl.constexpr):
        """Tensor-core version: each chunk's 16 words per row become one [BLOCK_N, 128 or 64] operand
        (magic-number lanes joined back into input order) for one `tl.dot` with the activations."""
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rw = tl.arange(0, 16)
        CHUNK: tl.constexpr = 128 if BITS == 4 else 64
        rk = tl.arange(0, CHUNK)
        n_ok, m_ok = rn < N, rm < M
        compute: tl.constexpr = x_ptr.dtype.element_ty
        first, last = _chunks(pid_k, K, BITS, STEPS, SPLIT_K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        high = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # int8: the high nibbles' products, worth 16x
        xsum_all = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(first, last, STEPS):
            for i in tl.static_range(STEPS):
                b = start + i
                ok = (rw * 0 + b) < last  # tensors, not a scalar: the interpreter masks with tensors only
                w = tl.load(w_ptr + rn[:, None] * (K * BITS // 32) + b * 16 + rw[None, :],
                            mask=n_ok[:, None] & ok[None, :], other=0)
                x = tl.load(x_ptr + rm[None, :] * stride_xm + b * CHUNK + rk[:, None],
                            mask=m_ok[None, :] & ((rk * 0 + b) < last)[:, None], other=0.0)  # [CHUNK, BLOCK_M]
                xsum = tl.sum(x.to(tl.float32), 0)
                if BITS == 4:  # nibble j of word w is input 8w + j; lanes s and s + 4 come out together
                    lo0, hi0 = _lanes((w & 0x000F000F) | MAGIC_BITS, compute)
                    lo1, hi1 = _lanes(((w >> 4) & 0x000F000F) | MAGIC_BITS, compute)
                    lo2, hi2 = _lanes(((w >> 8) & 0x000F000F) | MAGIC_BITS, compute)
                    lo3, hi3 = _lanes(((w >> 12) & 0x000F000F) | MAGIC_BITS, compute)
                    # tl.join adds the last (fastest) axis, so the first join picks the highest bit of j
                    a = tl.join(tl.join(tl.join(lo0, hi0), tl.join(lo2, hi2)),
                                tl.join(tl.join(lo1, hi1), tl.join(lo3, hi3)))
                    a = tl.reshape(a, (BLOCK_N, CHUNK))
                    if DOT_F32:
                        part = tl.dot(a.to(tl.float32), x.to(tl.float32))
                    else:
                        part = tl.dot(a, x)
                    sc = tl.load(scale_ptr + b * N + rn, mask=n_ok & (rn * 0 + b < last), other=0.0).to(tl.float32)
                    zp = tl.load(zero_ptr + b * N + rn, mask=n_ok & (rn * 0 + b < last), other=0.0).to(tl.float32)
                    acc += (part - (zp + MAGIC)[:, None] * xsum[None, :]) * sc[:, None]
                else:  # byte j of word w is input 4w + j, stored + 128; each nibble is a lane
                    l0, l2 = _lanes((w & 0x000F000F) | MAGIC_BITS, compute)
                    l1, l3 = _lanes(((w >> 8) & 0x000F000F) | MAGIC_BITS, compute)
                    h0, h2 = _lanes(((w >> 4) & 0x000F000F) | MAGIC_BITS, compute)
                    h1, h3 = _lanes(((w >> 12) & 0x000F000F) | MAGIC_BITS, compute)
                    lo = tl.reshape(tl.join(tl.join(l0, l2), tl.join(l1, l3)), (BLOCK_N, CHUNK))
                    hi = tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), (BLOCK_N, CHUNK))
                    if DOT_F32:
                        lo, hi, x = lo.to(tl.float32), hi.to(tl.float32), x.to(tl.float32)
                    acc = tl.dot(lo, x, acc)
                    high = tl.dot(hi, x, high)
                    xsum_all += xsum
        if BITS == 8:  # Σ x·(c + l) + 16·Σ x·(c + h) = Σ x·q + (17·c + 128)·Σ x
            sc = tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            acc = (acc + 16 * high - (17 * MAGIC + 128) * xsum_all[None, :]) * sc[:, None]
        _finish(acc, rn, rm, n_ok, m_ok, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr, count_ptr,
                SPLIT_K, HAS_BIAS, BLOCK_N, BLOCK_M)

    @triton.jit
    def _mma2_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                     M, N, K, stride_xm, stride_om, SPLIT_K,
                     BITS: tl.constexpr, HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr,
                     DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, STEPS: tl.constexpr):
        """Tensor-core version whose operands come from the stored bytes by elementwise steps only
        (int4: the low and the high nibbles as two operands, each dotted with the even or the odd
        inputs; int8: the byte), which Triton can apply after loading straight into the dot layout."""
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rb = tl.arange(0, 64)  # bytes of a row per chunk
        n_ok, m_ok = rn < N, rm < M
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
                w = tl.load(w_ptr + rn[:, None] * (K * BITS // 8) + b * 64 + rb[None, :],
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
        _finish(acc, rn, rm, n_ok, m_ok, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr, count_ptr,
                SPLIT_K, HAS_BIAS, BLOCK_N, BLOCK_M)

    @triton.jit
    def _fma_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                    M, N, K, stride_xm, stride_om, SPLIT_K,
                    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    STEPS: tl.constexpr):
        """CUDA-core version for 1–4 rows: a chunk's words are spread into a [rows, 16 words, 8 nibbles
        (4 bytes)] tensor, each value an fp32 made with two integer instructions and one add (the value
        under the exponent of 2^23, minus 2^23), multiplied by activations read as contiguous runs."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rw = tl.arange(0, 16)
        PER_WORD: tl.constexpr = 32 // BITS
        CHUNK: tl.constexpr = 16 * PER_WORD
        rj = tl.arange(0, PER_WORD)
        n_ok, m_ok = rn < N, rm < M
        first, last = _chunks(pid_k, K, BITS, STEPS, SPLIT_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        # input PER_WORD·w + j of the chunk, for word w and nibble (byte) j: runs of PER_WORD
        x_offsets = (PER_WORD * rw[:, None] + rj[None, :])[None, :, :] + rm[:, None, None] * stride_xm
        shifts = (BITS * rj)[None, None, :]
        for start in range(first, last, STEPS):
            for i in tl.static_range(STEPS):
                b = start + i
                ok = (rw * 0 + b) < last
                w = tl.load(w_ptr + rn[:, None] * (K // PER_WORD) + b * 16 + rw[None, :],
                            mask=n_ok[:, None] & ok[None, :], other=0)
                x = tl.load(x_ptr + b * CHUNK + x_offsets, mask=m_ok[:, None, None] & ok[None, :, None],
                            other=0.0).to(tl.float32)  # [BLOCK_M, 16, PER_WORD]
                bits = ((w[:, :, None] >> shifts) & (2 ** BITS - 1)) | 0x4B000000
                if BITS == 4:
                    q = bits.to(tl.float32, bitcast=True) - 8388608.0  # 0..15
                else:
                    q = bits.to(tl.float32, bitcast=True) - 8388736.0  # the byte held q + 128
                part = tl.sum(tl.sum(q[None, :, :, :] * x[:, None, :, :], 3), 2)  # [BLOCK_M, BLOCK_N]
                if BITS == 4:
                    xsum = tl.sum(tl.sum(x, 2), 1)
                    sc = tl.load(scale_ptr + b * N + rn, mask=n_ok & (rn * 0 + b < last), other=0.0).to(tl.float32)
                    zp = tl.load(zero_ptr + b * N + rn, mask=n_ok & (rn * 0 + b < last), other=0.0).to(tl.float32)
                    acc += (part - xsum[:, None] * zp[None, :]) * sc[None, :]
                else:
                    acc += part
        if BITS == 8:
            acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        _finish(tl.trans(acc), rn, rm, n_ok, m_ok, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr, count_ptr,
                SPLIT_K, HAS_BIAS, BLOCK_N, BLOCK_M)


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


def pack_int4(q: Tensor) -> Tensor:
    """Canonical int4 bytes [out, in/2] (input 2i in the low nibble of byte i) → kernel words [out, in/8]:
    the same bytes read as little-endian int32, so nibble j of word w is input 8w + j."""
    return q.contiguous().view(torch.int32)


def pack_int8(q: Tensor) -> Tensor:
    """int8 [out, in] → kernel words [out, in/4] holding q + 128 (the sign bit flipped): byte j of word w
    is input 4w + j, each nibble of it exact as a float lane."""
    return (q.contiguous().view(torch.uint8) ^ 0x80).view(torch.int32)


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
        return Config("mma", block_n=64, steps=1, split_k=1)
    block_n = 32
    tiles = -(-out_features // block_n)
    chunks = in_features // (GROUP if bits == 4 else 64)
    split = 1
    while tiles * split < 2 * processors and chunks // (split * 2) >= 8:
        split *= 2
    return Config("fma" if rows == 1 else "mma", block_n=block_n, steps=2, split_k=split)


def lowbit_matmul(x: Tensor, words: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, bits: int,
                  config: Config, workspace: Workspace | None) -> Tensor:
    """x [..., in] @ the packed weight's transpose (+ bias) → [..., out] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = words.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fma = config.kind == "fma" and m <= 4
    split = config.split_k if m <= BLOCK_M else 1
    block_m = (1 << (m - 1).bit_length()) if fma else (BLOCK_M if m <= BLOCK_M else 64)
    tiles = triton.cdiv(n, config.block_n)
    if split > 1:
        workspace.reserve(split * block_m * n, tiles)
        partials, counters = workspace.partials, workspace.counters
    else:
        partials = counters = out  # unused
    common = (x2, words, scale, zero if zero is not None else scale, bias if bias is not None else scale, out,
              partials, counters, m, n, k, x2.stride(0), out.stride(0), split)  # split: a value, not compiled in
    launch = dict(BITS=bits, HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_M=block_m, STEPS=config.steps,
                  num_warps=config.warps, num_stages=config.stages)
    if fma:
        _fma_kernel[(tiles, split)](*common, **launch)
    elif config.kind == "mma2":
        magic = 128.0 if x.dtype == torch.bfloat16 else 1024.0
        _mma2_kernel[(tiles, split, triton.cdiv(m, block_m))](
            x2, words.view(torch.uint8), *common[2:], MAGIC=magic, DOT_F32=INTERPRETED, **launch)
    else:
        magic_bits, magic = (0x43004300, 128.0) if x.dtype == torch.bfloat16 else (0x64006400, 1024.0)
        _mma_kernel[(tiles, split, triton.cdiv(m, block_m))](*common, MAGIC_BITS=magic_bits, MAGIC=magic,
                                                             DOT_F32=INTERPRETED, **launch)
    return out.view(*shape[:-1], n)


class LowBitWeight:
    """One layer's packed weight and how to launch on it: `config` for one row, `batch_config` for 2–16
    rows (the decode step; both tuned per GPU by `plugins.lowbit_tuning`), plain tiles for prefill."""

    def __init__(self, words: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, bits: int,
                 dtype: torch.dtype, workspace: Workspace):
        self.words, self.scale, self.zero, self.bias, self.bits, self.dtype = words, scale, zero, bias, bits, dtype
        self.workspace = workspace
        self.out_features = words.shape[0]
        self.in_features = words.shape[1] * (32 // bits)
        processors = torch.cuda.get_device_properties(words.device).multi_processor_count if words.is_cuda else 132
        self.config = default_config(bits, self.out_features, self.in_features, 1, processors)
        self.batch_config = default_config(bits, self.out_features, self.in_features, 8, processors)
        self.prefill = default_config(bits, self.out_features, self.in_features, BLOCK_M + 1, processors)

    def shape_key(self) -> str:
        """What a tuned launch shape is chosen for (layers alike in this run alike)."""
        return f"int{self.bits} {self.in_features}->{self.out_features}{' +bias' if self.bias is not None else ''}"

    def __call__(self, x: Tensor, config: Config | None = None) -> Tensor:
        rows = x.numel() // x.shape[-1]
        chosen = config or (self.config if rows == 1 else self.batch_config if rows <= BLOCK_M else self.prefill)
        return lowbit_matmul(x, self.words, self.scale, self.zero, self.bias, self.bits, chosen, self.workspace)
