"""One decoder-only transformer for Qwen v1, Qwen2/2.5, Qwen3 and LLaMA/Vicuna.

gpt-fast style: plain modules, fused q/k/v and gate/up projections (one GEMM each instead of three
and two). Family differences are switches on `DecoderConfig`: qkv bias, qk-norm, GQA, and Qwen v1's
logn scaling and dynamic NTK. The model holds weights only: the KV cache and the rotary tables
belong to the engine that schedules requests (`pipeline/llm/engine/torch_engine.py`) and come in as arguments,
with the step's parts: `Rows` (decode and verify: tokens for each of the cache's first B rows, each at its
own position), prompt `Chunk`s and a `Prefill` (a prompt read eagerly). One forward runs a whole engine
step: the GEMMs once over every part's tokens, the attention part by part.

State-dict names (the loaders map every checkpoint format onto these):
  embed.weight · layers.N.attn_norm.weight · layers.N.attn.wqkv.{weight,bias}
  layers.N.attn.{q_norm,k_norm}.weight · layers.N.attn.wo.weight · layers.N.mlp_norm.weight
  layers.N.mlp.w_gate_up.weight ([gate; up]) · layers.N.mlp.w_down.weight · norm.weight · lm_head.weight
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import ALL, Part, Prefill, Rows, Span, spans_of
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.weights.config import DecoderConfig
from plugins.chunk_attention import prefill_attention
from plugins.fused import FUSED, Kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalised in fp32 as every reference implementation does (bf16 variance loses digits).
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add(self, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        """(x + delta, its norm) in one pass over the residual stream; delta None adds nothing."""
        if delta is None:
            return x, self(x)
        return self.kernels.add_rms_norm(x, delta, self.weight, self.eps)



class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, kernels: Kernels):
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.wqkv = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.wo = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, kernels)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, logn: Tensor | None, k_cache: Tensor, v_cache: Tensor,
                spans: list[Span]) -> Tensor:
        """x [1, N, hidden]: the step's tokens, part after part; `k_cache`/`v_cache` are this layer's [rows,
        kv_heads, max_seq, head_dim]. The projections run once over all N tokens (the weights are read once
        per step); each part writes its keys and attends as its kind says (`_attend`)."""
        c = self.config
        n = x.shape[1]
        q, k, v = self.wqkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(1, n, c.num_heads, c.head_dim)
        k = k.view(1, n, c.num_kv_heads, c.head_dim)
        v = v.view(1, n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        ys = [self._attend(q[:, s.begin:s.end], k[:, s.begin:s.end], v[:, s.begin:s.end], cos[s.begin:s.end],
                           sin[s.begin:s.end], logn[s.begin:s.end] if logn is not None else None, k_cache, v_cache, s)
              for s in spans]
        return self.wo((ys[0] if len(ys) == 1 else torch.cat(ys)).view(1, n, c.q_size))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, logn: Tensor | None,
                k_cache: Tensor, v_cache: Tensor, span: Span) -> Tensor:
        """One part's attention → [size, q_size]. `Rows`: the decode attention, each query reading its row
        in place up to its own position. `Prefill`: SDPA over the row's keys up to its end, causal aligned
        to the last key (flash takes it as it is, grouped KV heads included). `Tokens`: the decode attention, each
        query over its own row in place up to its own length (places given as tensors, so graphable)."""
        c, part = self.config, span.part
        if isinstance(part, Rows):
            rows, per_row = part.starts.shape[0], part.per_row
            q, k, v = (t[0].view(rows, per_row, t.shape[2], c.head_dim) for t in (q, k, v))
            cos, sin = cos.view(rows, per_row, -1), sin.view(rows, per_row, -1)
            if per_row == 1:
                q = self.kernels.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, part.starts)
            else:
                q, k = self.kernels.rotary(q, cos, sin), self.kernels.rotary(k, cos, sin)
                at = torch.arange(rows, device=q.device)[:, None].expand(rows, per_row)
                positions = span.positions.view(rows, per_row)
                k_cache[at, :, positions] = k
                v_cache[at, :, positions] = v
            if logn is not None:
                q = q * logn.view(rows, per_row, 1, 1).to(q.dtype)
            return self.kernels.decode_attention(q.flatten(0, 1), k_cache, v_cache, span.lengths, part.kv_len,
                                                 tokens=per_row)
        size = q.shape[1]
        q, k = self.kernels.rotary(q, cos[None], sin[None]), self.kernels.rotary(k, cos[None], sin[None])
        if logn is not None:
            q = q * logn[None, :, None, None].to(q.dtype)
        if isinstance(part, Prefill):
            end = part.start + size
            k_cache[part.row, :, part.start:end] = k[0].transpose(0, 1)
            v_cache[part.row, :, part.start:end] = v[0].transpose(0, 1)
            keys, values = k_cache[part.row:part.row + 1, :, :end], v_cache[part.row:part.row + 1, :, :end]
            y = prefill_attention(q.transpose(1, 2), keys, values, part.start)
            return y[0].transpose(0, 1).reshape(size, c.q_size)
        k_cache[part.rows, :, part.positions] = k[0]
        v_cache[part.rows, :, part.positions] = v[0]
        return self.kernels.decode_attention(q[0], k_cache, v_cache, span.lengths, part.kv_len, rows=part.rows,
                                             tile_rows=part.tile_rows)


class FeedForward(nn.Module):
    """SwiGLU with gate and up fused into one GEMM (a low-bit one applies SiLU·mul itself, in its last step)."""

    def __init__(self, config: DecoderConfig, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.w_gate_up(x)
        return self.w_down(h if getattr(self.w_gate_up, "applies_silu_mul", False) else self.kernels.silu_mul(h))


class Block(nn.Module):
    def __init__(self, config: DecoderConfig, kernels: Kernels):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.attn = Attention(config, kernels)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = FeedForward(config, kernels)

    def forward(self, x: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, logn: Tensor | None,
                k_cache: Tensor, v_cache: Tensor, spans: list[Span]) -> tuple[Tensor, Tensor]:
        """The residual stream is `x + delta`; returns the stream and this block's own delta (its MLP's
        output), left for the next norm to add: each add is fused into the norm that follows it."""
        x, h = self.attn_norm.add(x, delta)
        x, h = self.mlp_norm.add(x, self.attn(h, cos, sin, logn, k_cache, v_cache, spans))
        return x, self.mlp(h)


class Decoder(nn.Module):
    """`kernels` picks the elementwise kernels between the GEMMs (fused Triton ones on CUDA by default)."""

    def __init__(self, config: DecoderConfig, kernels: Kernels = FUSED):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, kernels) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, cache: KVCache, rope: RotaryTables, parts: tuple[Part, ...], tokens: Tensor | None = None,
                embeds: Tensor | None = None, outputs: Tensor | slice | None = ALL,
                hidden: bool = False) -> Tensor | None:
        """Logits [1, P, vocab] for one engine step: `tokens` [1, N] (or ready-made `embeds` [1, N, hidden]),
        `parts` in order covering them: decode and verify rows, prompt chunks, a prompt read whole. The
        GEMMs run once over all N tokens. `outputs`: the positions (of the N) whose logits are wanted: a
        tensor of indices, `ALL`, or None for no logits (a prompt chunk before the last only writes the cache).
        `hidden`: the last layer's normalized states at those positions instead of logits (an embedder's output)."""
        x = self.embed(tokens) if embeds is None else embeds
        spans = spans_of(parts, x.shape[1], x.device)
        positions = spans[0].positions if len(spans) == 1 else torch.cat([s.positions for s in spans])
        rotary = spans[0].rotary if len(spans) == 1 else torch.cat([s.rotary for s in spans])
        cos, sin = rope.cos[rotary], rope.sin[rotary]
        for s in spans:
            if isinstance(s.part, Prefill) and s.part.rope is not None:  # a picture's tokens: three positions each
                cos[s.begin:s.end], sin[s.begin:s.end] = rope.sectioned(s.part.rope)
        logn = rope.logn[positions] if rope.logn is not None else None
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, cos, sin, logn, cache.k[i], cache.v[i], spans)
        if outputs is None:
            return None
        if isinstance(outputs, Tensor):
            x, delta = x.index_select(1, outputs), delta.index_select(1, outputs)
        return self.norm.add(x, delta)[1] if hidden else self.lm_head(self.norm.add(x, delta)[1])
