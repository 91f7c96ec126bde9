"""Fused decoder kernels (Triton) behind plain torch functions.

At batch 1 a decoder layer is ~40 kernels of which only four are the weight-bound GEMVs; the rest
(RMSNorm's seven elementwise passes, RoPE's ten, SiLU·up's two, the residual adds) cost more than
their math. The residual add is fused into the RMSNorm that follows it, and a decode step's RoPE
and KV-cache write (two rotations, an index and two scattered writes) are one kernel. Each
function here is one Triton kernel on CUDA when Triton is importable, and the reference torch code
everywhere else (the CPU, or `STUDIO_FUSED=0`), so results on the CPU are unchanged and the GPU
path is checked against that reference (`tests/test_gpu.py`).

RMSNorm and SiLU·up round exactly like the reference (bf16 products of fp32 values); RoPE keeps its
products in fp32 and rounds once, which is slightly more accurate than the reference's three roundings.

Which set a model uses is an explicit choice (`Kernels`, given to the model's constructor), not a
process-wide switch, so a benchmark can run fused and reference models side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from plugins.decode_attention import TILE_ROWS, INVARIANT_SPLIT, decode_attention

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None


def _use_triton(x: Tensor) -> bool:
    return triton is not None and x.is_cuda


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm_reference(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual stream after adding `delta` (rounded to x's dtype, as `x + delta` is) and its RMSNorm."""
    total = x + delta
    return total, rms_norm_reference(total, weight, eps)


def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [batch, tokens, heads, head_dim] with cos/sin [batch, tokens, head_dim] (fp32)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_cache_write_reference(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                               v_cache: Tensor, positions: Tensor) -> Tensor:
    """A decode step's RoPE and KV-cache write: q, k, v [B, 1, heads, head_dim] of rows 0..B-1 at
    `positions` [B]; k (rotated) and v go into the caches [rows, kv_heads, max_seq, head_dim]; returns
    the rotated q."""
    rows = torch.arange(q.shape[0], device=q.device)
    k_cache[rows, :, positions] = rotary_reference(k, cos, sin)[:, 0]
    v_cache[rows, :, positions] = v[:, 0]
    return rotary_reference(q, cos, sin)


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # round as the reference does before the weight
        tl.store(out_ptr + row * n_cols + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        total = (x + d).to(sum_ptr.dtype.element_ty)  # the residual stream keeps the model's dtype
        tl.store(sum_ptr + row * n_cols + cols, total, mask=mask)
        t = total.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = t * tl.rsqrt(tl.sum(t * t, axis=0) / n_cols + eps)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate(src, dst, cos, sin, half, BLOCK: tl.constexpr):
        """RoPE on one head: `src`'s two halves rotated by one position's cos/sin, rounded once into `dst`."""
        i = tl.arange(0, BLOCK)
        mask = i < half
        x1 = tl.load(src + i, mask=mask).to(tl.float32)
        x2 = tl.load(src + half + i, mask=mask).to(tl.float32)
        c1, c2 = tl.load(cos + i, mask=mask).to(tl.float32), tl.load(cos + half + i, mask=mask).to(tl.float32)
        s1, s2 = tl.load(sin + i, mask=mask).to(tl.float32), tl.load(sin + half + i, mask=mask).to(tl.float32)
        tl.store(dst + i, (x1 * c1 - x2 * s1).to(dst.dtype.element_ty), mask=mask)
        tl.store(dst + half + i, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, heads, half, row_stride, BLOCK: tl.constexpr):
        # one program per (token, head); x is [tokens, heads, 2*half] with rows `row_stride` apart
        pid = tl.program_id(0)
        token = pid // heads
        base = x_ptr + token * row_stride + (pid % heads) * 2 * half
        _rotate(base, base, cos_ptr + token * 2 * half, sin_ptr + token * 2 * half, half, BLOCK)

    @triton.jit
    def _rope_cache_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, pos_ptr, heads, row_stride,
                                 cache_row, cache_head, half, BLOCK: tl.constexpr):
        # one program per (row, head) over the q heads then the kv heads: q rotated in place; k rotated
        # and v copied into the caches at the row's position (the cache's token stride is 2*half)
        b, h = tl.program_id(0), tl.program_id(1)
        if h < heads:
            src = q_ptr + b * row_stride + h * 2 * half
            dst = src
        else:
            kh = h - heads
            src = k_ptr + b * row_stride + kh * 2 * half
            dst = kc_ptr + b * cache_row + kh * cache_head + tl.load(pos_ptr + b) * 2 * half
            v_src = v_ptr + b * row_stride + kh * 2 * half
            v_dst = vc_ptr + b * cache_row + kh * cache_head + tl.load(pos_ptr + b) * 2 * half
            i = tl.arange(0, BLOCK)
            tl.store(v_dst + i, tl.load(v_src + i, mask=i < half), mask=i < half)
            tl.store(v_dst + half + i, tl.load(v_src + half + i, mask=i < half), mask=i < half)
        _rotate(src, dst, cos_ptr + b * 2 * half, sin_ptr + b * 2 * half, half, BLOCK)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(gu_ptr + row * 2 * n + cols, mask=mask).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * n + n + cols, mask=mask).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu rounds here
        tl.store(out_ptr + row * n + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


_ahead = threading.local()


@contextlib.contextmanager
def compiling_ahead():
    """Inside (this thread), the fused kernels compile for the arguments they are given and launch nothing:
    stand-in tensors of a model's widths compile what its steps launch (`plugins.precompile.fused_calls`)."""
    before, _ahead.on = getattr(_ahead, "on", False), True
    try:
        yield
    finally:
        _ahead.on = before


def _launch(kernel, grid: tuple):
    return functools.partial(kernel.warmup, grid=grid) if getattr(_ahead, "on", False) else kernel[grid]


def rms_norm_fused(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """RMSNorm over the last dimension, into `out` when given (TensorRT's plugin hands its output buffer)."""
    if not _use_triton(x) or not x.is_contiguous():
        y = rms_norm_reference(x, weight, eps)
        return y if out is None else out.copy_(y)
    n = x.shape[-1]
    out = torch.empty_like(x) if out is None else out
    _launch(_rms_norm_kernel, (x.numel() // n,))(x, weight, out, n, eps, BLOCK=triton.next_power_of_2(n))
    return out


def add_rms_norm_fused(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`add_rms_norm_reference` in one kernel: the residual add and the norm after it read the stream once."""
    if not _use_triton(x) or not x.is_contiguous() or not delta.is_contiguous() or x.shape != delta.shape:
        return add_rms_norm_reference(x, delta, weight, eps)
    n = x.shape[-1]
    total, out = torch.empty_like(x), torch.empty_like(x)
    _launch(_add_rms_norm_kernel, (x.numel() // n,))(x, delta, weight, total, out, n, eps, BLOCK=triton.next_power_of_2(n))
    return total, out


def rotary_fused(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [batch, tokens, heads, head_dim] with cos/sin [batch, tokens, head_dim]; in place on CUDA."""
    batch, tokens, heads, dim = x.shape
    # Every (row, token) pair must lie one `step` after the last: a decode batch (one token per
    # row) steps by rows, a prefill (one row) by tokens.
    step = x.stride(1) if tokens > 1 else x.stride(0)
    if (not _use_triton(x) or x.stride(-1) != 1 or x.stride(2) != dim
            or (batch > 1 and tokens > 1 and x.stride(0) != tokens * x.stride(1))):
        return rotary_reference(x, cos, sin)
    cos, sin = cos.contiguous(), sin.contiguous()
    _launch(_rotary_kernel, (batch * tokens * heads,))(x, cos, sin, heads, dim // 2, step,
                                              BLOCK=triton.next_power_of_2(dim // 2))
    return x


def rope_cache_write_fused(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                           v_cache: Tensor, positions: Tensor) -> Tensor:
    """`rope_cache_write_reference` in one kernel (it was two RoPE kernels, an index and two scattered
    writes per layer); q is rotated in place. q, k, v are views of one row of the fused q/k/v output."""
    batch, tokens, heads, dim = q.shape
    kv_heads = k.shape[2]
    # Rows are `row_stride` apart in all three views. A batch of one has no second row: its views'
    # stride(0) is whatever `view` made of a size-1 dimension (and differs between q, k and v).
    row_stride = q.stride(0) if batch > 1 else 0
    if (not _use_triton(q) or tokens != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or any(t.stride(-1) != 1 or t.stride(2) != dim or (batch > 1 and t.stride(0) != row_stride)
                   for t in (q, k, v))):
        return rope_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, positions)
    global _rope_cache_write_failed
    if _rope_cache_write_failed:
        return rope_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, positions)
    cos, sin = cos.contiguous(), sin.contiguous()
    try:
        _launch(_rope_cache_write_kernel, (batch, heads + kv_heads))(
            q, k, v, cos, sin, k_cache, v_cache, positions.contiguous(), heads, row_stride, k_cache.stride(0),
            k_cache.stride(1), dim // 2, BLOCK=triton.next_power_of_2(dim // 2))
    except Exception as e:  # noqa: BLE001 - newest kernel here: a Triton that cannot compile it falls back, once, saying so
        if getattr(_ahead, "on", False):  # compiled ahead: the step's own call decides
            raise
        _rope_cache_write_failed = True
        warnings.warn(f"the fused RoPE + KV-cache kernel did not compile ({type(e).__name__}); using the torch "
                      f"reference for it", stacklevel=2)
        return rope_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, positions)
    return q


_rope_cache_write_failed = False  # set when the kernel failed to compile (the first call is outside any CUDA graph)


def silu_mul_fused(gate_up: Tensor) -> Tensor:
    """SiLU(gate) · up for gate_up = [gate; up] along the last dimension."""
    if not _use_triton(gate_up) or not gate_up.is_contiguous():
        return silu_mul_reference(gate_up)
    n = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * n)
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _launch(_silu_mul_kernel, (rows, triton.cdiv(n, block)))(gate_up, out, n, BLOCK=block)
    return out


def decode_attention_sdpa(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, kv_len: int,
                          tokens: int = 1, rows: Tensor | None = None, tile_rows: int = TILE_ROWS) -> Tensor:
    """The reference decode attention: SDPA over each row's cache slice [:kv_len] with the positions past
    each query's length masked (a length of 0: zeros); q [B, heads, head_dim] → [B, heads*head_dim], `tokens`
    queries per row, or each query its own row's, rows[b] (prompt tokens), given `rows` [B] (`tile_rows`, the
    kernel's tiling, changes nothing here)."""
    batch, heads, dim = q.shape
    tokens = 1 if rows is not None else tokens
    n = batch // tokens
    keys, values = ((c[:n, :, :kv_len] if rows is None else c[:, :, :kv_len].index_select(0, rows))
                    for c in (k_cache, v_cache))
    mask = (torch.arange(kv_len, device=q.device)[None] < lengths[:, None]).view(n, 1, tokens, kv_len)
    y = F.scaled_dot_product_attention(q.unflatten(0, (n, tokens)).transpose(1, 2), keys, values, attn_mask=mask,
                                       enable_gqa=heads != k_cache.shape[1])
    return y.transpose(1, 2).reshape(batch, heads * dim).nan_to_num(0.0)


def decode_attention_fused(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, kv_len: int,
                           tokens: int = 1, rows: Tensor | None = None, split_size: int | None = None,
                           tile_rows: int = TILE_ROWS) -> Tensor:
    """Our Triton kernel where it runs (CUDA); elsewhere SDPA, not the kernel's fp32 einsum reference: on
    the CPU that copies the KV heads out to every query head and made SmolLM2's decode 0.93× transformers'
    (216 µs a layer against SDPA's 65 µs, `bench/real_model.py`). `split_size`: the kernel's batch-invariant sums."""
    if q.is_cuda:
        return decode_attention(q, k_cache, v_cache, lengths, kv_len, tokens=tokens, rows=rows, split_size=split_size,
                                tile_rows=tile_rows)
    return decode_attention_sdpa(q, k_cache, v_cache, lengths, kv_len, tokens, rows)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernels a decoder runs between its GEMMs: norms, RoPE (+ the KV write), SiLU·up, decode attention."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]  # (x + delta, its norm)
    rotary: Callable[[Tensor, Tensor, Tensor], Tensor]  # may work in place
    rope_cache_write: Callable[..., Tensor]  # a decode step's RoPE and KV write; may rotate q in place
    silu_mul: Callable[[Tensor], Tensor]
    decode_attention: Callable[..., Tensor]  # q [B, heads, dim] → [B, heads·dim]; `tokens` queries per cache row
    # (`row`: a prompt chunk's)


REFERENCE = Kernels(rms_norm_reference, add_rms_norm_reference, rotary_reference, rope_cache_write_reference,
                    silu_mul_reference, decode_attention_sdpa)
FUSED = Kernels(rms_norm_fused, add_rms_norm_fused, rotary_fused, rope_cache_write_fused, silu_mul_fused,
                decode_attention_fused)  # each falls back to the reference wherever Triton cannot run
# batch-invariant mode (`pipeline.llm.model.invariant`): the same, with the attention's splits of a fixed size (the
# norms, RoPE and SiLU·up compute each row alone already)
INVARIANT = dataclasses.replace(FUSED, decode_attention=functools.partial(decode_attention_fused,
                                                                          split_size=INVARIANT_SPLIT))
