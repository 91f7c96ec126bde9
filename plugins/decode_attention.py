"""Decode attention (one new token per running sequence) over the KV cache in place: flash-decoding in
two Triton launches.

The decode step ran SDPA with a boolean mask over the bucketed cache slice `[:B, :, :kv_len]`: it reads
every padded position of every row (kv_len is rounded up to a multiple of 256 for the CUDA graphs) and
may copy the grouped KV heads. This reads only each row's valid positions, in place, once for the whole
GQA group.

`_split_kernel`: one program per (split, row, kv head) scores a contiguous span of positions for all q
heads of that kv head (the group padded to 16 rows for `tl.dot`) and writes fp32 (max, sum, output)
partials to a workspace; splits past the row's length read nothing. `_merge_kernel`: one program per
(row, q head) merges that head's splits by log-sum-exp. Both grids depend on B and kv_len (the cache's
size) only, never on `lengths`: the splits share out each row's own length (`_span`), so one CUDA graph
serves a step at any length and a graph table need not be keyed by it (workspaces are cached per device
and size class and never freed, so graphs keep their addresses; calls on one device must not run
concurrently on two streams).

Why two launches: a single launch where the last split program of each (row, kv head) merges the
partials (found with an atomic counter) was built and was correct on an H100, but that one program
reads all splits x group x head_dim partials alone, so at batch 1 with 4 kv heads it took 15-45 us
where the separate merge, spread over B x heads programs, takes 8-15 us (kv_len 4096-16384, Qwen2.5-7B
shapes; masked SDPA: 17-23 us).

Prompt tokens (`rows` given: each query's cache row; one request's or several, laid out in runs of
`tile_queries`) run the same two launches, each split program scoring a tile of a prompt's queries (all q
heads of a kv head) so each key is loaded once per tile: FlashAttention's variable-length
kernel, which it replaced, gives one program per (128 queries, head) and reads the earlier keys serially,
so 7 running chats' step grew from 8.6 to 12.2 ms while an 8th read its 4,000 tokens in chunks of 256
(H200, 2026-11-27).

On the CPU, or without Triton, `decode_attention` runs `decode_attention_reference`.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
from torch import Tensor

from plugins.workspaces import workspace

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None


def _use_triton(x: Tensor) -> bool:
    return triton is not None and x.is_cuda


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, kv_len: int,
                               out: Tensor | None = None, tokens: int = 1, rows: Tensor | None = None) -> Tensor:
    """q [B, heads, head_dim]; caches [rows, kv_heads, max_seq, head_dim]; query b attends to positions
    0..lengths[b]-1 of cache row b // tokens (of row rows[b] when `rows` [B] is given), within the first kv_len
    (a length of 0: zeros). Math in fp32; returns [B, heads*head_dim]."""
    batch, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    if rows is None:
        rows = torch.arange(batch // tokens, device=q.device).repeat_interleave(tokens)
    keys = k_cache[:, :, :kv_len].index_select(0, rows).float().repeat_interleave(group, 1)
    values = v_cache[:, :, :kv_len].index_select(0, rows).float().repeat_interleave(group, 1)
    scores = torch.einsum("bhd,bhnd->bhn", q.float(), keys) / math.sqrt(dim)
    valid = torch.arange(kv_len, device=q.device) < lengths[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    y = torch.einsum("bhn,bhnd->bhd", scores.softmax(-1).nan_to_num(0.0), values).reshape(batch, heads * dim).to(q.dtype)
    return y if out is None else out.copy_(y)


if triton is not None:
    @triton.jit
    def _span(length, n_splits, BLOCK_N: tl.constexpr):
        """Positions per split: the tile's length shared out over the splits, in whole blocks."""
        return tl.cdiv(tl.cdiv(length, n_splits), BLOCK_N) * BLOCK_N

    # The lengths are values, not compiled in, and the merge's lane counts are compiled at the first call:
    # Triton would otherwise compile a kernel again where a length first equals 1 or the splits reach a new
    # power of two (a short context, a verify step's few splits), in the middle of a reply (seen on an H100:
    # 0.2-0.4 s each).
    @triton.jit(do_not_specialize=["batch", "kv_len", "n_splits"])
    def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, row_ptr, acc_ptr, ml_ptr, stride_qb, stride_qh, stride_kb, stride_kh,
                      batch, kv_len, n_splits, qk_scale, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                      GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                      PRECISION: tl.constexpr, TOKENS: tl.constexpr, QUERIES: tl.constexpr, ROWS: tl.constexpr,
                      ROW: tl.constexpr, SPLIT_SIZE: tl.constexpr):
        # DOT: the dtype of tl.dot's operands (the cache's, or float32 under the interpreter, whose dot
        # multiplies bf16 bit patterns as integers; bf16 products are exact in fp32, so the numbers agree).
        # A program scores QUERIES consecutive queries of one cache row (ROWS >= QUERIES x GROUP rows, query
        # qi's head g at row qi * GROUP + g; one query: its group padded to GROUP_PAD rows); ROW: the cache
        # row is read from row_ptr (prompt tokens: each query's row, the same for a tile's), else it is the first
        # query's // TOKENS. The splits share out the tile's own positions (`_span`), so the grid depends on no length;
        # SPLIT_SIZE > 0: each split is that many positions (batch-invariant sums).
        split, tile_kh = tl.program_id(0), tl.program_id(1)
        tile, kh = tile_kh // KV_HEADS, tile_kh % KV_HEADS
        r, d = tl.arange(0, ROWS), tl.arange(0, DIM)
        qi, g = r // GROUP, r % GROUP
        b = tile * QUERIES + qi
        real = (qi < QUERIES) & (b < batch)  # rows past the tile's queries pad it for tl.dot: q = 0, never stored
        lengths = tl.minimum(tl.load(len_ptr + b, mask=real, other=0).to(tl.int32), kv_len)
        length = tl.max(lengths, 0)
        span = SPLIT_SIZE if SPLIT_SIZE > 0 else _span(length, n_splits, BLOCK_N)
        start = split * span
        if start < length:  # splits past the queries' lengths read nothing
            q = tl.load(q_ptr + b.to(tl.int64)[:, None] * stride_qb + (kh * GROUP + g)[:, None] * stride_qh + d[None, :],
                        mask=real[:, None], other=0.0)
            row = tl.load(row_ptr + tile * QUERIES) if ROW else tile * QUERIES // TOKENS
            kv_off = row.to(tl.int64) * stride_kb + kh * stride_kh
            # running max of the scores (log2 units); -1e30 for -inf: a row with no position here makes no NaN
            m = tl.full([ROWS], -1e30, tl.float32)
            l = tl.zeros([ROWS], tl.float32)  # running sum of exp2(score - m)
            acc = tl.zeros([ROWS, DIM], tl.float32)
            end = tl.minimum(start + span, length)
            for n0 in range(start, end, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                valid = n < end
                offs = kv_off + n[:, None] * DIM + d[None, :]
                k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
                s = tl.dot(q.to(DOT), tl.trans(k).to(DOT), input_precision=PRECISION) * qk_scale
                s = tl.where(valid[None, :] & (n[None, :] < lengths[:, None]), s, float("-inf"))  # up to its own length
                m_new = tl.maximum(m, tl.max(s, 1))
                p = tl.math.exp2(s - m_new[:, None])
                alpha = tl.math.exp2(m - m_new)
                v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT), v.to(DOT), input_precision=PRECISION)
                l = l * alpha + tl.sum(p, 1)
                m = m_new
            # this split's rows in the workspace; a query with no position in it stores rows the merge skips
            part = ((b * KV_HEADS + kh) * n_splits + split) * GROUP_PAD + g
            tl.store(acc_ptr + part[:, None] * DIM + d[None, :], acc, mask=real[:, None])
            tl.store(ml_ptr + 2 * part, m, mask=real)
            tl.store(ml_ptr + 2 * part + 1, l, mask=real)

    @triton.jit(do_not_specialize=["batch", "kv_len", "n_splits"])
    def _merge_kernel(len_ptr, out_ptr, acc_ptr, ml_ptr, batch, kv_len, n_splits, KV_HEADS: tl.constexpr,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, LANES: tl.constexpr,
                      BLOCK_N: tl.constexpr, QUERIES: tl.constexpr, QUERIES_PAD: tl.constexpr, SPLIT_SIZE: tl.constexpr):
        # One program per (row, q head): its splits' partials, rows first + s*GROUP_PAD, by log-sum-exp.
        # Lane j keeps its own running state over splits j, j+LANES, .. (independent loads, no reduction
        # in the loop); -1e30 stands for -inf so that an idle lane makes no NaN.
        bh = tl.program_id(0)
        b, h = bh // (KV_HEADS * GROUP), bh % (KV_HEADS * GROUP)
        # the splits that held positions: as the tile's programs shared out its longest query's positions
        qi = tl.arange(0, QUERIES_PAD)
        tile_q = b // QUERIES * QUERIES + qi
        tile_length = tl.max(tl.minimum(tl.load(len_ptr + tile_q, mask=(qi < QUERIES) & (tile_q < batch), other=0)
                                        .to(tl.int32), kv_len), 0)
        span = SPLIT_SIZE if SPLIT_SIZE > 0 else _span(tile_length, n_splits, BLOCK_N)
        n_valid = tl.cdiv(tl.minimum(tl.load(len_ptr + b).to(tl.int32), kv_len), tl.maximum(span, 1))
        first = (b * KV_HEADS + h // GROUP) * n_splits * GROUP_PAD + h % GROUP
        lane, d = tl.arange(0, LANES), tl.arange(0, DIM)
        m = tl.full([LANES], -1e30, tl.float32)
        l = tl.zeros([LANES], tl.float32)
        o = tl.zeros([LANES, DIM], tl.float32)
        for s0 in range(0, n_valid, LANES):
            ok = s0 + lane < n_valid
            row = first + (s0 + lane) * GROUP_PAD
            m_s = tl.load(ml_ptr + 2 * row, mask=ok, other=-1e30)
            l_s = tl.load(ml_ptr + 2 * row + 1, mask=ok, other=0.0)
            o_s = tl.load(acc_ptr + row[:, None] * DIM + d[None, :], mask=ok[:, None], other=0.0)
            m_new = tl.maximum(m, m_s)
            alpha, beta = tl.math.exp2(m - m_new), tl.math.exp2(m_s - m_new)
            l = l * alpha + l_s * beta
            o = o * alpha[:, None] + o_s * beta[:, None]
            m = m_new
        w = tl.math.exp2(m - tl.max(m, 0))
        total = tl.sum(l * w, 0)
        o = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # a padding query (length 0): zeros
        tl.store(out_ptr + bh.to(tl.int64) * DIM + d, o.to(out_ptr.dtype.element_ty))


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if triton else {}
_MERGE_TILE = 4096  # fp32 partial outputs a merge program loads at once (LANES x head_dim)
# A prompt chunk's program: its queries x group rows, one load of each key for all of them. Per layer at 28/4 heads
# (H200, `results/chunk_attention_h200_2026-11-29_tiles.json`), 128 rows against 64: a 256-token chunk 3,744 deep
# 108 against 147 µs, 16,000 deep 341 against 544, a 1,024-token one 30,000 deep 1,900 against 3,799; 256 rows:
# 1,583 there, but 155 against 90 µs for 1,024 tokens at the start (`prompt_tile_rows`)
TILE_ROWS = 128
LONG_TILE_ROWS = 256
LONG_CHUNK, DEEP = 512, 8192  # an eager call's longest chunk this long, this deep takes LONG_TILE_ROWS
INVARIANT_SPLIT = 256  # positions per split in batch-invariant mode (`split_size`)
# batch-invariant prompt queries: at most this many splits (each query keeps every split's partial sums: splits of
# INVARIANT_SPLIT asked 4.4 GB for a 1,024-token chunk at a 32k context, 7B shapes)
PROMPT_SPLITS = 8
_INVARIANT_LANES = 16  # the merge's lanes then: a fixed number, so every row's splits are added in one order
_sm_counts: dict[int, int] = {}
_failed = False  # set when a kernel failed to compile (the first call is outside any CUDA graph)


def _lanes(n_splits: int, dim: int) -> int:
    """The merge's lanes: one per split, up to a tile of `_MERGE_TILE` partial outputs."""
    return min(triton.next_power_of_2(n_splits), max(1, _MERGE_TILE // dim))


_merges_compiled: set[tuple] = set()  # (device, dtype, kv heads, group, dim, ..) whose merge kernels are compiled


def _splits(kv_len: int, programs_per_split: int, device: torch.device) -> int:
    """The grid's splits: about two programs per SM, each reading at least 64 of `kv_len` positions. A
    program's positions are its tile's length shared out over them (`_span`), so the grid depends on the cache's
    size alone, never on the lengths: one CUDA graph serves every length."""
    if device.type == "cuda":
        if device.index not in _sm_counts:
            _sm_counts[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
        target = 2 * _sm_counts[device.index]
    else:
        target = 2 * 132  # the interpreter: as on an H100
    return max(1, min(triton.cdiv(target, programs_per_split), triton.cdiv(kv_len, 64)))


def prompt_tile_rows(tokens: int, start: int) -> int:
    """The tile for an eager call whose longest chunk has `tokens` from position `start` (its caller lays each
    chunk out in runs of the tile's queries, `tile_queries`): long and deep, `LONG_TILE_ROWS` (each key loaded half
    as often; a short prompt read beside a 32k one took 56 ms a step against 25 alone with `TILE_ROWS`, H200
    2026-11-30), else `TILE_ROWS`."""
    return LONG_TILE_ROWS if tokens >= LONG_CHUNK and start >= DEEP else TILE_ROWS


def split_length(kv_len: int, split_size: int, prompt: bool) -> int:
    """Positions per split of batch-invariant sums: `split_size` for decode rows; for prompt queries (many a call)
    enough that `kv_len` takes at most `PROMPT_SPLITS` (a prompt's `kv_len` is its cache's whole length, the same
    in every call of an engine, so its sums still follow no batch)."""
    return max(split_size, triton.cdiv(triton.cdiv(kv_len, PROMPT_SPLITS), 64) * 64) if prompt else split_size


def tile_queries(heads: int, kv_heads: int, tile_rows: int = TILE_ROWS) -> int:
    """Prompt tokens a program scores together (`rows`): a caller lays each row's tokens out in runs of this many
    (`tile_rows`: head rows a program holds, `TILE_ROWS` unless the call names more: `LONG_TILE_ROWS`)."""
    return max(1, tile_rows // (heads // kv_heads))


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, kv_len: int,
                     out: Tensor | None = None, tokens: int = 1, rows: Tensor | None = None,
                     compile_only: bool = False, split_size: int | None = None, tile_rows: int = TILE_ROWS) -> Tensor:
    """Attention of one new token per row: q [B, heads, head_dim] (rows may be strided, e.g. a view of
    the fused q/k/v output), caches [rows >= B, kv_heads, max_seq, head_dim], lengths int64 [B] (the
    valid positions of each row, <= kv_len; 0: a padding query, whose output is zeros). Returns [B, heads*head_dim]
    in q's dtype, written into `out` when given. The launches depend on B and kv_len, never on the values in
    `lengths`. `tokens` > 1: that many queries per cache row, query b reading row b // tokens up to its own
    length (a verify step's positions, causal among them by their lengths). `rows` [B] (prompt tokens, of one
    request or several): query b reads cache row rows[b], and a program scores `tile_queries` consecutive
    queries at once, which must share a row (each of a decode or verify step's queries has its own program,
    whose splits share out its own length: a verify reads exactly a decode step's sums). `compile_only`:
    compile the kernels this call needs (in Triton's `AsyncCompileMode`: in the background) and launch
    nothing; what they compile for depends on the dtypes, heads, head_dim, and `tokens` or else `rows` only
    (prompt tokens' kernel is the same for any count; every stride is a multiple of 16), so small stand-in
    tensors compile a model's (`plugins.precompile.attention_calls`). `split_size` (a multiple of 64): batch-invariant
    sums: each split is that many positions from a row's start, and the merge adds them in one order, so a query's
    output is the same bits in any batch, tile or cache size (the default shares each row's length out over about
    two programs per SM, so the sums follow the batch). `tile_rows`: prompt tokens' head rows a program holds
    (queries laid out in runs of `tile_queries(heads, kv_heads, tile_rows)`)."""
    global _failed
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if (not _use_triton(q) or _failed or dim < 16 or dim & (dim - 1) or heads % kv_heads
            or q.dtype not in _TL_DTYPES or q.dtype != k_cache.dtype or q.dtype != v_cache.dtype
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        return decode_attention_reference(q, k_cache, v_cache, lengths, kv_len, out, tokens, rows)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if rows is not None and rows.stride(0) != 1:  # the kernel reads it by offset (an expanded row: one element)
        rows = rows.contiguous()
    if out is None:
        out = torch.empty(batch, heads * dim, dtype=q.dtype, device=q.device)
    assert out.shape == (batch, heads * dim) and out.dtype == q.dtype and out.is_contiguous(), "bad `out`"
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    queries = tile_queries(heads, kv_heads, tile_rows) if rows is not None else 1
    tile_rows = max(16, triton.next_power_of_2(queries * group))
    tiles = triton.cdiv(batch, queries)
    # a verify step splits as a decode step of its rows: the same sums
    split_size = split_size and split_length(kv_len, split_size, rows is not None)
    n_splits = triton.cdiv(kv_len, split_size) if split_size else \
        _splits(kv_len, (tiles if rows is not None else batch // tokens) * kv_heads, q.device)
    slots = batch * kv_heads * n_splits * group_pad
    partials = workspace(q.device, slots * (dim + 2))  # each row's output, then its (max, sum)
    acc, ml = partials[:slots * dim], partials[slots * dim:]
    dot = _TL_DTYPES[q.dtype] if q.is_cuda else tl.float32  # CPU tensors: the interpreter (tests)
    block_n = max(16, min(64, 16384 // (dim * q.element_size())))
    merge_args = (lengths, out, acc, ml, batch, kv_len, n_splits)
    merge_kw = dict(KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, DIM=dim, BLOCK_N=block_n, QUERIES=queries,
                    QUERIES_PAD=triton.next_power_of_2(queries), SPLIT_SIZE=split_size or 0, num_warps=4)
    lanes = _INVARIANT_LANES if split_size else _lanes(n_splits, dim)

    def launch(kernel, grid):
        return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]

    try:
        compiled = (q.device, q.dtype, kv_heads, group, dim, queries, split_size)
        if q.is_cuda and compiled not in _merges_compiled:
            _merges_compiled.add(compiled)
            for each in {_lanes(2 ** i, dim) for i in range(12)} if not split_size else {lanes}:  # every lane count
                _merge_kernel.warmup(*merge_args, LANES=each, grid=(batch * heads,), **merge_kw)  # a length can ask for
        launch(_split_kernel, (n_splits, tiles * kv_heads))(
            q, k_cache, v_cache, lengths, lengths if rows is None else rows, acc, ml, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), batch, kv_len, n_splits, math.log2(math.e) / math.sqrt(dim),
            KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, DIM=dim, BLOCK_N=block_n, DOT=dot,
            PRECISION="ieee" if dot == tl.float32 else "tf32", TOKENS=1 if rows is not None else tokens, QUERIES=queries,
            ROWS=tile_rows, ROW=rows is not None, SPLIT_SIZE=split_size or 0,
            num_warps=8 if dim * q.element_size() * tile_rows >= 8192 else 4,
            num_stages=2)  # tile and warps: no register spills up to bf16 x 256 and fp32 x 256
        launch(_merge_kernel, (batch * heads,))(*merge_args, LANES=lanes, **merge_kw)
    except Exception as e:  # noqa: BLE001 - a Triton that cannot compile them falls back, once, saying so
        if compile_only:  # compiled ahead: the step's own call decides
            raise
        _failed = True
        warnings.warn(f"the decode-attention kernels did not compile ({type(e).__name__}: {e}); using the torch "
                      f"reference for them", stacklevel=2)
        return decode_attention_reference(q, k_cache, v_cache, lengths, kv_len, out, tokens, rows)
    return out
