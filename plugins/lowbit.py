"""Weight-only int4 (grouped) and int8 (per channel) matrix products for batch 1–16 and prefill (Triton).

Why our own kernel: a quantized decode step reads every weight once, so its time is the weight
bytes over memory bandwidth, provided dequantization keeps up. On Hopper it barely does: the H200
must turn ~37 int4 weights per SM per clock into math, and the usual way (integer unpack, then a
int→float conversion at 16 per SM per clock) is capped near 0.45 of bandwidth. Here:

- **Magic-number dequantization.** A 32-bit word of packed nibbles becomes two bf16 lanes with one
  shift and one AND-OR: `(w >> s) & 0x000F000F | 0x43004300` is the bf16 pair (128 + q₁, 128 + q₂),
  exact (fp16 models use 0x6400: 1024 + q). No per-element conversion instruction.
- **Tensor cores at batch 1.** The lanes feed `tl.dot` with the activations padded to 16 rows, so a
  batch of 1 and a batch of 16 cost the same: eight chats decode in one weight pass.
- **The offset and the zero point come out once per group**, from the activations' group sum:
  Σ x·(q − z)·s = (Σ x·(128 + q) − (128 + z)·Σ x)·s, in fp32.
- **A pre-shuffled layout, so activations are read in runs of 16.** In a group of 128 inputs, word
  w (0–15) of a row holds nibble j = input 16·j + w; the shift for nibble s yields inputs
  16·s + w (low lane) and 16·(s + 4) + w (high lane). int8 does the same per 64 inputs with each
  byte's two nibbles (the weight stored + 128): u = 16·h + l, two exact bf16 lanes per byte.
- **Split-K without fills or a reduction launch.** Where a layer has few output tiles (the down
  projection), several programs share a tile's inputs, write fp32 partials to a workspace, and the
  last one to arrive (an atomic counter) adds them in a fixed order and resets the counter. One
  launch, no zero-fill, deterministic sums.

Layouts (`pack`): `words` int32 [out, in/8] (int4) or [out, in/4] (int8, stored as q + 128);
`scale` [groups, out] in the model's dtype (int4; `zero` likewise) or float32 [1, out] (int8).
The on-disk format stays the canonical one of `pipeline/llm/quant.py`; this layout is made at load.

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
WORDS = 16  # int32 words of a row per group (int4) or per block (int8)
BLOCK_M = 16  # activation rows per program: tl.dot's smallest tile, so batches 1–16 cost one pass
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch shape: output rows per program, groups (or blocks) per loop step, programs per
    output tile along the inputs, and Triton's warps and pipeline depth."""

    block_n: int = 64
    steps: int = 1
    split_k: int = 1
    warps: int = 4
    stages: int = 3


if triton is not None:
    @triton.jit
    def _lowbit_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                       M, N, K, stride_xm, stride_om,
                       BITS: tl.constexpr, HAS_BIAS: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC: tl.constexpr,
                       DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, STEPS: tl.constexpr,
                       SPLIT_K):
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rw = tl.arange(0, 16)
        n_ok, m_ok = rn < N, rm < M
        chunk: tl.constexpr = 128 if BITS == 4 else 64  # inputs per 16 words
        blocks = K // chunk
        row_words = K // (32 // BITS)
        per_split = tl.cdiv(tl.cdiv(blocks, SPLIT_K), STEPS) * STEPS
        first = pid_k * per_split
        last = tl.minimum(first + per_split, blocks)
        compute = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        xsum_all = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(first, last, STEPS):
            for i in tl.static_range(STEPS):
                b = start + i
                ok = (rw * 0 + b) < last  # a tensor, not a scalar: the interpreter masks with tensors only
                w = tl.load(w_ptr + rn[:, None] * row_words + b * 16 + rw[None, :], mask=n_ok[:, None] & ok[None, :], other=0)
                xb = x_ptr + rm[None, :] * stride_xm + b * chunk + rw[:, None]  # x transposed: [16, BLOCK_M]
                x_ok = m_ok[None, :] & ok[:, None]
                part = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                high = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # int8: the high nibbles' products, worth 16×
                xsum = tl.zeros((BLOCK_M,), tl.float32)
                for s in tl.static_range(4):
                    if BITS == 4:
                        t = ((w >> (4 * s)) & 0x000F000F) | MAGIC_BITS
                        x_lo = tl.load(xb + 16 * s, mask=x_ok, other=0.0)
                        x_hi = tl.load(xb + 16 * (s + 4), mask=x_ok, other=0.0)
                        xsum += tl.sum(x_lo.to(tl.float32), 0) + tl.sum(x_hi.to(tl.float32), 0)
                    else:  # bytes 0–3 of a word are inputs w, 16 + w, 32 + w, 48 + w; high nibbles count 16×
                        t = ((w >> (8 * (s % 2) + 4 * (s // 2))) & 0x000F000F) | MAGIC_BITS
                        x_lo = tl.load(xb + 16 * (s % 2), mask=x_ok, other=0.0)
                        x_hi = tl.load(xb + 16 * (s % 2 + 2), mask=x_ok, other=0.0)
                        if s < 2:
                            xsum += tl.sum(x_lo.to(tl.float32), 0) + tl.sum(x_hi.to(tl.float32), 0)
                    lo = t.to(tl.int16).to(compute, bitcast=True)
                    hi = (t >> 16).to(tl.int16).to(compute, bitcast=True)
                    if DOT_F32:
                        lo, hi, x_lo, x_hi = lo.to(tl.float32), hi.to(tl.float32), x_lo.to(tl.float32), x_hi.to(tl.float32)
                    if BITS == 8 and s >= 2:
                        high = tl.dot(lo, x_lo, high)
                        high = tl.dot(hi, x_hi, high)
                    else:
                        part = tl.dot(lo, x_lo, part)
                        part = tl.dot(hi, x_hi, part)
                if BITS == 4:
                    sc = tl.load(scale_ptr + b * N + rn, mask=n_ok & (rn * 0 + b < last), other=0.0).to(tl.float32)
                    zp = tl.load(zero_ptr + b * N + rn, mask=n_ok & (rn * 0 + b < last), other=0.0).to(tl.float32) + MAGIC
                    acc += (part - zp[:, None] * xsum[None, :]) * sc[:, None]
                else:
                    acc += part + 16 * high
                    xsum_all += xsum
        if BITS == 8:  # Σ x·(c + l) + 16·Σ x·(c + h) = Σ x·q + (17·c + 128)·Σ x
            sc = tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            acc = (acc - (17 * MAGIC + 128) * xsum_all[None, :]) * sc[:, None]
        writer = n_ok  # the rows this program writes out: all of its tile, or, split, only if it came last
        if SPLIT_K > 1:
            n_all = n_ok[:, None] & (tl.arange(0, BLOCK_M)[None, :] < BLOCK_M)
            tl.store(part_ptr + (pid_k * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]) * N + rn[:, None], acc,
                     mask=n_all)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            writer = n_ok & ((rn * 0 + arrived) == SPLIT_K - 1)
            if arrived == SPLIT_K - 1:
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                for k in range(SPLIT_K):  # in split order: the same sum on every run
                    acc += tl.load(part_ptr + (k * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]) * N + rn[:, None],
                                   mask=n_all, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call: no fill launch
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=writer[:, None] & m_ok[None, :])


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
    """Canonical int4 bytes [out, in/2] (element 2i low nibble of byte i) → kernel words [out, in/8]."""
    out, half = q.shape
    values = torch.stack((q & 15, q >> 4), dim=-1).view(out, half * 2 // GROUP, 8, WORDS).to(torch.int32)
    words = sum(values[:, :, j] << (4 * j) for j in range(8))  # word w holds inputs 16·j + w of its group
    return words.reshape(out, -1).contiguous()


def pack_int8(q: Tensor) -> Tensor:
    """int8 [out, in] → kernel words [out, in/4] holding q + 128, byte i of word w = input 16·i + w of its 64."""
    out, n = q.shape
    values = (q.to(torch.int32) + 128).view(out, n // 64, 4, WORDS)
    words = sum(values[:, :, i] << (8 * i) for i in range(4))
    return words.reshape(out, -1).contiguous()


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
        return Config(block_n=64, steps=1, split_k=1, warps=4, stages=3)
    block_n = 32
    tiles = -(-out_features // block_n)
    blocks = in_features // (GROUP if bits == 4 else 64)
    split = 1
    while tiles * split < 2 * processors and blocks // (split * 2) >= 8:
        split *= 2
    return Config(block_n=block_n, steps=2, split_k=split, warps=4, stages=3)


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
    split = config.split_k if m <= BLOCK_M else 1
    block_m = BLOCK_M if m <= BLOCK_M else 64
    tiles = triton.cdiv(n, config.block_n)
    if split > 1:
        workspace.reserve(split * BLOCK_M * n, tiles)
        partials, counters = workspace.partials, workspace.counters
    else:
        partials = counters = out  # unused
    magic_bits, magic = (0x43004300, 128.0) if x.dtype == torch.bfloat16 else (0x64006400, 1024.0)
    grid = (tiles, split, triton.cdiv(m, block_m))
    _lowbit_kernel[grid](
        x2, words, scale, zero if zero is not None else scale, bias if bias is not None else scale, out, partials,
        counters, m, n, k, x2.stride(0), out.stride(0),
        BITS=bits, HAS_BIAS=bias is not None, MAGIC_BITS=magic_bits, MAGIC=magic, DOT_F32=INTERPRETED,
        BLOCK_N=config.block_n, BLOCK_M=block_m, STEPS=config.steps, SPLIT_K=split,  # SPLIT_K is not compiled in
        num_warps=config.warps, num_stages=config.stages)
    return out.view(*shape[:-1], n)


class LowBitWeight:
    """One layer's packed weight and how to launch on it: `config` for batches up to 16 (the decode
    step; tuned per GPU by `plugins.lowbit_tuning`), the untuned prefill tiles above that."""

    def __init__(self, words: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, bits: int,
                 dtype: torch.dtype, workspace: Workspace, config: Config | None = None):
        self.words, self.scale, self.zero, self.bias, self.bits, self.dtype = words, scale, zero, bias, bits, dtype
        self.workspace = workspace
        self.out_features = words.shape[0]
        self.in_features = words.shape[1] * (32 // bits)
        processors = torch.cuda.get_device_properties(words.device).multi_processor_count if words.is_cuda else 132
        self.config = config or default_config(bits, self.out_features, self.in_features, 1, processors)
        self.prefill = default_config(bits, self.out_features, self.in_features, BLOCK_M + 1, processors)

    def shape_key(self) -> str:
        """What a tuned launch shape is chosen for (layers alike in this run alike)."""
        return f"int{self.bits} {self.in_features}->{self.out_features}{' +bias' if self.bias is not None else ''}"

    def __call__(self, x: Tensor, config: Config | None = None) -> Tensor:
        rows = x.numel() // x.shape[-1]
        chosen = config or (self.config if rows <= BLOCK_M else self.prefill)
        return lowbit_matmul(x, self.words, self.scale, self.zero, self.bias, self.bits, chosen, self.workspace)
