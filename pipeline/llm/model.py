"""One decoder-only transformer for Qwen v1, Qwen2/2.5, Qwen3 and LLaMA/Vicuna.

gpt-fast style: plain modules, a static KV cache owned by each attention layer, fused q/k/v and
gate/up projections (one GEMM each instead of three and two). Family differences are switches
on `DecoderConfig`: qkv bias, qk-norm, GQA, and Qwen v1's logn scaling and dynamic NTK.

State-dict names (the loaders map every checkpoint format onto these):
  embed.weight · layers.N.attn_norm.weight · layers.N.attn.wqkv.{weight,bias}
  layers.N.attn.{q_norm,k_norm}.weight · layers.N.attn.wo.weight · layers.N.mlp_norm.weight
  layers.N.mlp.w_gate_up.weight ([gate; up]) · layers.N.mlp.w_down.weight · norm.weight · lm_head.weight
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.llm.config import DecoderConfig
from plugins.fused import rms_norm, rotary_, silu_mul


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalised in fp32 as every reference implementation does (bf16 variance loses digits);
        # one fused kernel on CUDA.
        return rms_norm(x, self.weight, self.eps)


class KVCache(nn.Module):
    """Static cache [batch, kv_heads, max_seq, head_dim]: fixed addresses, so decode can be graphed."""

    def __init__(self, batch: int, max_seq: int, kv_heads: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


def rope_tables(head_dim: int, max_seq: int, theta: float, device=None) -> tuple[Tensor, Tensor]:
    """cos/sin [max_seq, head_dim] in the half-split layout shared by all four families."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def qwen_ntk_alpha(context_len: int, seq_length: int) -> float:
    """Qwen v1's dynamic NTK factor: 1 within the trained length, then 3, 7, 15… per doubling."""
    context_value = math.log(context_len / seq_length, 2) + 1
    return max(2 ** math.ceil(context_value) - 1, 1)


def qwen_logn_scale(max_seq: int, seq_length: int) -> Tensor:
    """Qwen v1's per-position query scale log_{seq_length}(pos+1), 1 within the trained length."""
    pos = torch.arange(1, max_seq + 1, dtype=torch.float64)
    scale = torch.where(pos > seq_length, pos.log() / math.log(seq_length), torch.ones_like(pos))
    return scale.float()


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.wqkv = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.wo = nn.Linear(config.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, input_pos: Tensor,
                logn: Tensor | None, kv_len: int) -> Tensor:
        """`mask` None means a fresh prefill (positions 0..T-1): plain causal attention, which lets
        SDPA pick its flash kernel instead of the masked one."""
        c = self.config
        bsz, seqlen, _ = x.shape
        q, k, v = self.wqkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(bsz, seqlen, c.num_heads, c.head_dim)
        k = k.view(bsz, seqlen, c.num_kv_heads, c.head_dim)
        v = v.view(bsz, seqlen, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary_(q, cos, sin), rotary_(k, cos, sin)
        if logn is not None:
            q = q * logn[:, None, None].to(q.dtype)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k_all, v_all = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(
            q, k_all[:, :, :kv_len], v_all[:, :, :kv_len], attn_mask=mask, is_causal=mask is None,
            enable_gqa=c.num_heads != c.num_kv_heads,
        )
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, c.q_size))


class FeedForward(nn.Module):
    """SwiGLU with gate and up fused into one GEMM."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(silu_mul(self.w_gate_up(x)))


class Block(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, input_pos: Tensor,
                logn: Tensor | None, kv_len: int) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, input_pos, logn, kv_len)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.max_seq_len = 0
        self.ntk_alpha = 1.0

    def setup_caches(self, max_seq_len: int, batch: int = 1) -> None:
        """Allocate the static KV cache and position tables for sequences up to `max_seq_len`."""
        c = self.config
        if max_seq_len > c.max_position_embeddings:
            raise ValueError(f"context {max_seq_len} exceeds the model's {c.max_position_embeddings} positions")
        weight = self.embed.weight
        for layer in self.layers:
            layer.attn.kv_cache = KVCache(batch, max_seq_len, c.num_kv_heads, c.head_dim, weight.dtype, weight.device)
        self.max_seq_len = max_seq_len
        self.register_buffer("positions", torch.arange(max_seq_len, device=weight.device), persistent=False)
        cos, sin = rope_tables(c.head_dim, max_seq_len, c.rope_theta, weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.ntk_alpha = 1.0
        if c.logn_attn:
            self.register_buffer("logn", qwen_logn_scale(max_seq_len, c.seq_length).to(weight.device),
                                 persistent=False)

    def prepare_context(self, context_len: int) -> None:
        """Before a prefill of `context_len` tokens: Qwen v1 rescales RoPE for long prompts (NTK).

        The factor is fixed at prefill and kept through decoding, as Qwen v1 does; the tables are
        rewritten in place so captured decode graphs keep valid pointers.
        """
        c = self.config
        if not c.dynamic_ntk:
            return
        alpha = qwen_ntk_alpha(context_len, c.seq_length)
        if alpha == self.ntk_alpha:
            return
        theta = c.rope_theta * alpha ** (c.head_dim / (c.head_dim - 2))
        cos, sin = rope_tables(c.head_dim, self.max_seq_len, theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        self.ntk_alpha = alpha

    def forward(self, input_pos: Tensor, idx: Tensor | None = None, embeds: Tensor | None = None,
                kv_len: int | None = None, last_only: bool = False) -> Tensor:
        """Logits for tokens `idx` (or ready-made `embeds`) written at cache positions `input_pos`.

        `kv_len` bounds how much of the cache attention reads (all of it when None, as a captured
        decode graph needs); `last_only` skips the LM head for all but the last position (prefill).
        """
        x = self.embed(idx) if embeds is None else embeds
        kv_len = kv_len or self.max_seq_len
        fresh_prefill = kv_len == x.shape[1]  # the cache holds exactly these tokens, at 0..T-1
        mask = None if fresh_prefill else (self.positions[None, :kv_len] <= input_pos[:, None])[None, None]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        logn = self.logn[input_pos] if self.config.logn_attn else None
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos, logn, kv_len)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))
