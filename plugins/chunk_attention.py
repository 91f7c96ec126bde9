"""A prompt chunk's attention: its queries against every key of its row up to its end, causal aligned to
the last key (the chunk's own positions masked among themselves, the earlier ones all visible).

Why its own function: on a GPU SDPA's flash kernel takes the lower-right causal mask as it is; on a CPU
SDPA has no such kernel and runs its math path over the materialised mask, which made a lone long prompt
read in chunks 2.2× slower than read whole (`bench/RESULTS.md`, issue 41).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right


def prefill_attention(q: Tensor, keys: Tensor, values: Tensor, start: int) -> Tensor:
    """q [1, heads, T, head_dim] at positions start..start+T-1; keys and values [1, kv_heads, start + T,
    head_dim] → [1, heads, T, head_dim]. A fresh prompt (start 0) is plain causal attention."""
    mask = None if start == 0 else causal_lower_right(q.shape[2], keys.shape[2])
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=keys.shape[1] != q.shape[1])
