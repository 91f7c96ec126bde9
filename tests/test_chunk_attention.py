"""`prefill_attention` (a prompt chunk's attention, causal aligned to the last key) equals SDPA over the
materialised lower-right causal mask, in fp32, for fresh prompts, later chunks, one-token chunks, grouped
KV heads and odd lengths; on the CPU it is computed as two halves merged by their log-sum-exps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from plugins.chunk_attention import prefill_attention


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    reps = q.shape[1] // keys.shape[1]
    mask = causal_lower_right(q.shape[2], keys.shape[2])._materialize(q.device)
    return F.scaled_dot_product_attention(q, keys.repeat_interleave(reps, 1), values.repeat_interleave(reps, 1),
                                          attn_mask=mask)


@pytest.mark.parametrize("heads, kv_heads, head_dim, start, size", [
    (4, 4, 32, 0, 17),      # a fresh prompt
    (4, 4, 32, 40, 24),     # a later chunk
    (9, 3, 64, 0, 1),       # one-token prompt, SmolLM2's grouping
    (9, 3, 64, 1, 1),       # one-token chunk after one key
    (9, 3, 64, 123, 1),     # one-token chunk after many
    (9, 3, 64, 257, 131),   # odd lengths past the kernel's blocks
    (7, 1, 16, 5, 300),     # chunk longer than its prefix, one KV head (Qwen2.5-7B's 28 / 4 scaled down)
    (14, 2, 48, 513, 77),
    (2, 2, 80, 1000, 2),
])
def test_matches_masked_sdpa(heads: int, kv_heads: int, head_dim: int, start: int, size: int) -> None:
    torch.manual_seed(start * 31 + size)
    q = torch.randn(1, heads, size, head_dim)
    keys, values = (torch.randn(1, kv_heads, start + size, head_dim) for _ in range(2))
    got = prefill_attention(q, keys, values, start)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, reference(q, keys, values), rtol=1e-5, atol=1e-5)


def test_engine_layout() -> None:
    """As the model calls it: q transposed from [1, T, heads, d], keys a row's slice of the cache."""
    torch.manual_seed(0)
    start, size, heads, kv_heads, d = 300, 45, 9, 3, 64
    q = torch.randn(1, size, heads, d).transpose(1, 2)
    k_cache, v_cache = (torch.randn(3, kv_heads, 512, d) for _ in range(2))
    keys, values = k_cache[1:2, :, :start + size], v_cache[1:2, :, :start + size]
    torch.testing.assert_close(prefill_attention(q, keys, values, start), reference(q, keys, values),
                               rtol=1e-5, atol=1e-5)


def test_large_scores() -> None:
    """Scores far apart (one half dominating) merge without overflow."""
    torch.manual_seed(1)
    q = torch.randn(1, 4, 33, 32) * 12
    keys, values = (torch.randn(1, 2, 100, 32) * 3 for _ in range(2))
    torch.testing.assert_close(prefill_attention(q, keys, values, 67), reference(q, keys, values),
                               rtol=1e-5, atol=1e-5)
