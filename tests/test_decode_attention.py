"""`plugins/decode_attention.py`: the reference against per-row SDPA, the split choice, and the Triton kernels
under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) against the reference: rows of different
lengths (1, a split boundary, kv_len), garbage past each row's length and in unused cache rows, q as a
strided view of a fused q/k/v row, every output element written, a second call on the reused workspace; with
fixed-size splits (batch-invariant mode) a decode query's bits alone, in a batch, under a larger cache bucket.
On a GPU the compiled kernels were checked the same way (bf16/fp16/fp32, head_dim 16-256, CUDA graphs)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plugins import decode_attention as da

ROOT = Path(__file__).resolve().parents[1]


def test_reference_matches_sdpa_over_each_rows_valid_positions():
    torch.manual_seed(0)
    heads, kv_heads, dim, lengths = 6, 2, 16, [5, 1, 12]
    q = torch.randn(3, heads, dim)
    k_cache, v_cache = torch.randn(2, 4, kv_heads, 16, dim)
    got = da.decode_attention_reference(q, k_cache, v_cache, torch.tensor(lengths), 12)
    for b, n in enumerate(lengths):
        keys, values = (c[b, :, :n].repeat_interleave(heads // kv_heads, 0) for c in (k_cache, v_cache))
        want = F.scaled_dot_product_attention(q[b, :, None], keys, values, scale=1 / math.sqrt(dim))
        torch.testing.assert_close(got[b], want.reshape(-1))
    assert torch.equal(da.decode_attention(q, k_cache, v_cache, torch.tensor(lengths), 12), got)  # CPU: the reference


@pytest.mark.skipif(da.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize(("kv_len", "batch_kv_heads", "splits"), [(256, 4, 4), (4096, 4, 64), (32768, 4, 66),
                                                                  (4096, 128, 3), (256, 512, 1)])
def test_split_choice_spreads_over_the_gpu(kv_len, batch_kv_heads, splits):
    """About two programs per SM (132 SMs under the interpreter), each with 64 positions at least: by the cache's
    size alone, so a graph serves every length."""
    assert da._splits(kv_len, batch_kv_heads, torch.device("cpu")) == splits


SCRIPT = r'''
import torch
from torch.nn.attention.bias import causal_lower_right
from plugins import decode_attention as da
da._use_triton = lambda x: True  # the interpreter runs the kernel on CPU tensors
torch.manual_seed(0)

def worst(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

def check(dtype, tol, heads, kv_heads, dim, lengths, kv_len, stale=False):
    """`stale`: a call with every row at kv_len (reading the garbage) first fills the workspace, so a call
    that used a partial it did not write itself would show; then two calls in a row."""
    batch, rows, max_seq = len(lengths), len(lengths) + 2, kv_len + 16
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * dim).to(dtype)  # the fused projection's output
    q = qkv[:, 0, :heads * dim].view(batch, heads, dim)  # rows (heads + 2*kv_heads)*dim apart
    k_cache, v_cache = (torch.randn(rows, kv_heads, max_seq, dim).to(dtype) for _ in range(2))
    for b in range(rows):  # garbage past each row's length and in the rows beyond the batch
        n = lengths[b] if b < batch else 0
        k_cache[b, :, n:], v_cache[b, :, n:] = 100.0, 1e4
    lengths = torch.tensor(lengths)
    expected = da.decode_attention_reference(q, k_cache, v_cache, lengths, kv_len)
    if stale:
        da.decode_attention(q, k_cache, v_cache, torch.full_like(lengths, kv_len), kv_len)
    for _ in range(2 if stale else 1):
        out = torch.full((batch, heads * dim), float("nan"), dtype=dtype)
        got = da.decode_attention(q, k_cache, v_cache, lengths, kv_len, out)
        assert got is out and not out.isnan().any(), "an output element was not written"
        err = worst(out, expected)
        assert err <= tol, (dtype, heads, kv_heads, dim, lengths.tolist(), kv_len, err)

for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
    check(dtype, tol, 8, 2, 16, [64, 1, 192], 192, stale=True)  # GQA: a split boundary, one position, kv_len
    check(dtype, tol, 4, 4, 32, [150], 192)  # MHA, batch 1
check(torch.float32, 1e-5, 6, 2, 32, [100, 192, 63], 192)  # a group of 3 (padded to 16)
da._MERGE_TILE = 0  # the merge takes one split at a time
check(torch.float32, 1e-5, 8, 2, 16, [64, 1, 192], 192)
splits = da._splits
da._splits = lambda kv_len, programs, device: 2  # two splits: a row of 256 positions in two spans of 128
check(torch.float32, 1e-5, 8, 2, 16, [128, 129, 5], 256, stale=True)
check(torch.bfloat16, 1e-2, 8, 2, 32, [256, 70], 256)

# a verify step: 3 queries per cache row, each up to its own position (rows 0 and 1 of the cache)
q = torch.randn(6, 8, 16)
k_cache, v_cache = (torch.randn(4, 2, 272, 16) for _ in range(2))
lengths = torch.tensor([100, 101, 102, 1, 2, 3])
expected = da.decode_attention_reference(q, k_cache, v_cache, lengths, 256, tokens=3)
for b in range(6):  # query b: row b // 3, as a lone decode query of that length
    alone = da.decode_attention_reference(q[b:b + 1], k_cache[b // 3:b // 3 + 1], v_cache[b // 3:b // 3 + 1],
                                          lengths[b:b + 1], 256)
    assert worst(expected[b:b + 1], alone) < 1e-6, b
assert worst(da.decode_attention(q, k_cache, v_cache, lengths, 256, tokens=3), expected) < 1e-5

# a prompt chunk: 33 queries of cache row 2 at positions 100..132, tiles of 16, 32 and 64 queries (64, 128 and
# 256 head rows; the last tile short: 1, 1 and 33 queries), splits of 128 positions (queries up to 128 have none in
# the second); the reference equals SDPA's causal attention aligned to the last key. bf16 in one tile size: the
# interpreter's dots are fp32 in any dtype (on the CPU a tile's code follows its size, not the dtype)
rows, lengths = torch.full((33,), 2), torch.arange(101, 134)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
    q, k_cache, v_cache = (t.to(dtype) for t in (torch.randn(33, 8, 16), *(torch.randn(4, 2, 272, 16) for _ in range(2))))
    k_cache[2, :, 133:], v_cache[2, :, 133:] = 100.0, 1e4  # garbage past the chunk's end
    expected = da.decode_attention_reference(q, k_cache, v_cache, lengths, 256, rows=rows)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k_cache[2:3, :, :133].float(), v_cache[2:3, :, :133].float(),
        attn_mask=causal_lower_right(33, 133), enable_gqa=True)
    assert worst(expected, sdpa[0].transpose(0, 1).reshape(33, 128)) < tol
    for tile_rows in (64, da.TILE_ROWS, da.LONG_TILE_ROWS) if dtype == torch.float32 else (da.TILE_ROWS,):
        out = torch.full((33, 128), float("nan"), dtype=dtype)
        da.decode_attention(q, k_cache, v_cache, lengths, 256, out, rows=rows, tile_rows=tile_rows)
        assert not out.isnan().any() and worst(out, expected) < tol, (dtype, tile_rows, worst(out, expected))

# two prompts' tokens in one call, each run starting a tile (of 64 // 4 = 16 queries here), padding queries
# (length 0: zeros) between and after them: each query as its own prompt's alone (the splits as chosen)
da._splits = splits
tile = da.tile_queries(8, 2, 64)
q, k_cache, v_cache = torch.randn(64, 8, 16), *(torch.randn(4, 2, 272, 16) for _ in range(2))
rows = torch.tensor([1] * 20 + [1] * (tile - 4) + [3] * 7 + [0] * (64 - 2 * tile - 7))
lengths = torch.tensor([*range(31, 51)] + [0] * (tile - 4) + [*range(200, 207)] + [0] * (64 - 2 * tile - 7))
out = torch.full((64, 128), float("nan"))
da.decode_attention(q, k_cache, v_cache, lengths, 256, out, rows=rows, tile_rows=64)
# one prompt's row given as an expanded tensor (a stride of 0): read as its values, not past its one element
one = da.decode_attention(q[:20], k_cache, v_cache, lengths[:20], 256, rows=torch.tensor([1]).expand(20))
assert torch.equal(one, da.decode_attention(q[:20], k_cache, v_cache, lengths[:20], 256, rows=torch.full((20,), 1)))
for b in range(64):
    alone = da.decode_attention_reference(q[b:b + 1], k_cache, v_cache, lengths[b:b + 1], 256, rows=rows[b:b + 1])
    assert worst(out[b:b + 1], alone) < 1e-5 if lengths[b] else not out[b].any(), b

# fixed-size splits (batch-invariant mode): a decode query's output is the same bits alone, in a batch and under
# a larger cache bucket (the grid follows them, the sums do not); a prompt's queries as the reference's. (Bit for
# bit in any tile only on a GPU: the interpreter's dot is numpy's, whose sums follow a row's place in the tile;
# `bench/invariant_kernels.py` and `tests/test_gpu.py` check that there.)
q, k_cache, v_cache = torch.randn(3, 8, 16), *(torch.randn(4, 2, 704, 16) for _ in range(2))
lengths = torch.tensor([300, 1, 513])
batch = da.decode_attention(q, k_cache, v_cache, lengths, 576, split_size=128)
assert worst(batch, da.decode_attention_reference(q, k_cache, v_cache, lengths, 576)) < 1e-5
assert torch.equal(batch, da.decode_attention(q, k_cache, v_cache, lengths, 704, split_size=128))
for b in range(3):
    alone = da.decode_attention(q[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1], lengths[b:b + 1], 576, split_size=128)
    assert torch.equal(alone, batch[b:b + 1]), b
rows, lengths = torch.full((40,), 2), torch.arange(101, 141)
q = torch.randn(40, 8, 16)
whole = da.decode_attention(q, k_cache, v_cache, lengths, 256, rows=rows, split_size=64)
assert worst(whole, da.decode_attention_reference(q, k_cache, v_cache, lengths, 256, rows=rows)) < 1e-5
# a prompt's queries over a long cache: at most PROMPT_SPLITS splits (each query keeps every split's sums)
assert da.split_length(32768, 256, prompt=True) == 4096 and da.split_length(32768, 256, prompt=False) == 256
assert da.split_length(700, 64, prompt=True) == 128 and da.split_length(256, 64, prompt=True) == 64
lengths = torch.arange(601, 641)
long = da.decode_attention(q, k_cache, v_cache, lengths, 704, rows=rows, split_size=64)
assert worst(long, da.decode_attention_reference(q, k_cache, v_cache, lengths, 704, rows=rows)) < 1e-5
print("ok")
'''


@pytest.mark.skipif(da.triton is None, reason="Triton is not installed")
def test_decode_attention_kernel_matches_the_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
