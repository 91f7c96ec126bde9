"""A prompt chunk's attention: its queries against every key of its row up to its end, causal aligned to
the last key (the chunk's own positions masked among themselves, the earlier ones all visible).

Why its own function: on a GPU SDPA's flash kernel takes the lower-right causal mask as it is (kept
as it was). On a CPU SDPA has no such kernel: it runs over the materialised mask, every key of every
query. So on the CPU the keys are split: the prefix [0, start), all visible, and the chunk's own keys,
plain causal (square, so SDPA's upper-left causal is aligned), each by the CPU flash kernel, which reads
grouped KV heads as they are and returns the log-sum-exp; the halves merge exactly, each half's output
weighted by exp(its lse - the joint lse). The flash kernel with the mask in one call was no faster (it
computes the masked blocks); an empty prefix crashes it, so a fresh prompt goes to SDPA's causal path.

Measured (`bench/short_behind_long.py`, RESULTS.md; 2-core CPU, SmolLM2-135M's 9 heads / 3 KV heads of
64, fp32), per layer: a 2,048-token chunk over 7,000 keys 0.20 s, against 0.27 s masked; the four chunks
of a 7,000-token prompt 0.41 s against 0.55 s, all 7,000 causal in one call 0.40 s. A lone 7,000-token
prompt read in chunks of 2,048 reaches its first token in 1.01× its whole-read time (22.1 s against
21.9 s), against 1.15× with the masked attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def prefill_attention(q: Tensor, keys: Tensor, values: Tensor, start: int) -> Tensor:
    """q [1, heads, T, head_dim] at positions start..start+T-1; keys and values [1, kv_heads, start + T,
    head_dim] → [1, heads, T, head_dim]. A fresh prompt (start 0) is plain causal attention."""
    gqa = keys.shape[1] != q.shape[1]
    if start == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
    if q.device.type != "cpu":
        from torch.nn.attention.bias import causal_lower_right  # here: it imports torch._dynamo, 1.8 s of a launch

        return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(q.shape[2], keys.shape[2]),
                                              enable_gqa=gqa)
    seen, seen_lse = _flash_cpu(q, keys[:, :, :start], values[:, :, :start])
    own, own_lse = _flash_cpu(q, keys[:, :, start:], values[:, :, start:], is_causal=True)
    # softmax over both halves = each half's softmax weighted by exp(its lse - the joint lse); the prefix's
    # weight is sigmoid(seen_lse - own_lse), the chunk's 1 minus it
    weight = torch.sigmoid(seen_lse - own_lse).unsqueeze(-1)
    return torch.lerp(own.float(), seen.float(), weight).to(q.dtype)
