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

import dataclasses
import math

import numpy as np
import torch
from torch import Tensor, nn

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


class KVCache:
    """Keys and values [layers, rows, kv_heads, max_seq, head_dim] at fixed addresses (graphable).

    A row holds one sequence. The engine keeps the rows of running requests first, so a batched
    decode step reads rows 0..B-1 as a plain view, and moves a row with `swap_rows` when a
    request joins or leaves (a copy of the filled part, once per event, not per step).
    """

    def __init__(self, config: DecoderConfig, rows: int, max_seq: int, dtype: torch.dtype, device):
        shape = (config.num_layers, rows, config.num_kv_heads, max_seq, config.head_dim)
        self.k, self.v = (_zeros(shape, dtype, torch.device(device)) for _ in range(2))
        self.rows, self.max_seq = rows, max_seq

    @staticmethod
    def row_bytes(config: DecoderConfig, max_seq: int, dtype: torch.dtype) -> int:
        return 2 * config.num_layers * config.num_kv_heads * max_seq * config.head_dim * dtype.itemsize

    def swap_rows(self, a: int, b: int, length: int) -> None:
        """Exchange the first `length` positions of rows a and b in every layer."""
        if a == b or length == 0:
            return
        for t in (self.k, self.v):
            held = t[:, a, :, :length].clone()
            t[:, a, :, :length] = t[:, b, :, :length]
            t[:, b, :, :length] = held


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros; on the CPU from the OS's zeroed pages (calloc): resident as chats fill them, not all at once."""
    cpu = device.type == "cpu" and dtype == torch.float32
    return torch.from_numpy(np.zeros(shape, np.float32)) if cpu else torch.zeros(shape, dtype=dtype, device=device)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> tuple[Tensor, float]:
    """RoPE's per-pair frequencies, and the factor cos/sin are multiplied by, for `scaling`
    (`DecoderConfig.rope_scaling` as a dict; empty: plain RoPE). The formulas are those of the papers
    and of Meta's and transformers' implementations, which the tests compare against."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind, factor = scaling.get("rope_type"), scaling.get("factor", 1.0)
    if kind is None:
        return inv, 1.0
    if kind == "linear":  # positions divided by the factor
        return inv / factor, 1.0
    original = scaling["original_max_position_embeddings"]
    if kind == "llama3":  # long wavelengths slowed by the factor, short ones kept, a smooth blend between
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
        blended = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(wavelen > original / low, inv / factor, torch.where(wavelen < original / high, inv, blended)), 1.0
    # yarn: interpolate the low frequencies, extrapolate the high ones, a linear ramp between (by pair index)
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def pair_for(rotations: float) -> float:  # the pair index that turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair_for(scaling.get("beta_fast") or 32), pair_for(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp), float(attention)


def rope_tables(head_dim: int, max_seq: int, theta: float, device=None,
                scaling: tuple[tuple[str, object], ...] = ()) -> tuple[Tensor, Tensor]:
    """cos/sin [max_seq, head_dim] in the half-split layout shared by all four families."""
    inv_freq, attention = inverse_frequencies(head_dim, theta, dict(scaling))
    freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32, device=device), inv_freq.to(device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention


def qwen_ntk_alpha(context_len: int, seq_length: int) -> float:
    """Qwen v1's dynamic NTK factor: 1 within the trained length, then 3, 7, 15… per doubling."""
    context_value = math.log(context_len / seq_length, 2) + 1
    return max(2 ** math.ceil(context_value) - 1, 1)


def qwen_logn_scale(max_seq: int, seq_length: int) -> Tensor:
    """Qwen v1's per-position query scale log_{seq_length}(pos+1), 1 within the trained length."""
    pos = torch.arange(1, max_seq + 1, dtype=torch.float64)
    scale = torch.where(pos > seq_length, pos.log() / math.log(seq_length), torch.ones_like(pos))
    return scale.float()


class RotaryTables:
    """Position tables for sequences up to `max_seq`, flattened: cos/sin [tables * max_seq, head_dim].

    Most models have one table. Qwen v1's dynamic NTK picks the RoPE base from the prompt length
    at prefill (alpha 1, 3, 7, … per doubling past `seq_length`) and keeps it while decoding, so
    requests of different lengths use different tables: one per alpha. A part reads row
    `offset + position` (`offset`): its table's start, plus an M-RoPE model's shift (Qwen2.5-VL: a text
    token after a picture sits at its index plus the shift, negative, since the picture's tokens take
    fewer positions than slots). The picture's own tokens have three positions each (time, row,
    column), one per section of the rotary pairs (`sectioned`).
    """

    def __init__(self, config: DecoderConfig, max_seq: int, device):
        c = config
        self.config, self.max_seq = config, max_seq
        self.alphas = [1.0]
        if c.dynamic_ntk:
            while self.alphas[-1] < qwen_ntk_alpha(max_seq, c.seq_length):
                self.alphas.append(self.alphas[-1] * 2 + 1)
        tables = [rope_tables(c.head_dim, max_seq, c.rope_theta * a ** (c.head_dim / (c.head_dim - 2)), device,
                              c.rope_scaling) for a in self.alphas]
        self.cos = torch.cat([cos for cos, _ in tables])
        self.sin = torch.cat([sin for _, sin in tables])
        self.logn = qwen_logn_scale(max_seq, c.seq_length).to(device) if c.logn_attn else None
        sections = c.mrope_section or (c.head_dim // 2,)
        pairs = torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(sections))
        self._section = torch.cat([pairs, pairs]).to(device)  # which of the three positions each dim reads

    def table_for(self, context_len: int) -> int:
        """Which table a prompt of `context_len` tokens uses (always 0 without dynamic NTK)."""
        if not self.config.dynamic_ntk:
            return 0
        return self.alphas.index(qwen_ntk_alpha(context_len, self.config.seq_length))

    def offset(self, table: int, shift: int = 0) -> int:
        """The row of the flat tables that position 0 of `table` reads, moved by an M-RoPE `shift`."""
        return table * self.max_seq + shift

    def sectioned(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin [n, head_dim] for M-RoPE `positions` [3, n]: each rotary pair turns by the position of
        its section (time, row or column; `DecoderConfig.mrope_section` pairs each)."""
        index = positions.to(self.cos.device)[self._section]  # [head_dim, n]: the position each dim turns by
        dims = torch.arange(self.cos.shape[1], device=self.cos.device)[:, None]
        return self.cos[index, dims].T, self.sin[index, dims].T


@dataclasses.dataclass(frozen=True)
class Rows:
    """`per_row` tokens for each cache row 0..B-1, row b's at positions starts[b].. with rotary offset
    offsets[b] (`RotaryTables.offset`): one for a decode step, the last token and the tokens drafted after
    it for speculative decoding's check (a decode step is a check without drafts). Each query attends in
    place to its row up to its own position (the decode attention), reading at most the first `kv_len`
    positions."""

    starts: Tensor
    offsets: Tensor
    kv_len: int
    per_row: int = 1


@dataclasses.dataclass(frozen=True)
class Prefill:
    """A prompt's tokens at positions start.. of cache row `row` (`size` of them; 0: all the step's
    tokens left), read eagerly: its keys are read exactly up to its end, causal attention aligned to
    the last key (plain causal attention for a fresh prompt, which skips the masked half). Rotary: each
    token at `offset` + its position, or, given, at its own M-RoPE positions `rope` [3, size]."""

    row: int
    start: int
    offset: int = 0
    size: int = 0
    rope: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A prompt chunk of `size` tokens (padded to a fixed length) of cache row `row` [1] at positions
    `start` [1].. with rotary offset `offset` [1], all tensors, attending to the row's first `kv_len`
    positions (a mask hides those past each query): its shapes stay the same from chunk to chunk, so a
    CUDA graph replays it."""

    row: Tensor
    start: Tensor
    offset: Tensor
    kv_len: int
    size: int


Part = Rows | Prefill | Chunk
ALL = slice(None)  # `Decoder.forward`'s outputs: logits at every position


@dataclasses.dataclass(frozen=True)
class _Span:
    """A part's place in the step's flat token list, its tokens' positions in the cache and rows of the
    rotary tables [size]."""

    part: Part
    begin: int
    end: int
    positions: Tensor
    rotary: Tensor


def _spans(parts: tuple[Part, ...], total: int, device: torch.device) -> list[_Span]:
    spans, begin = [], 0
    for part in parts:
        if isinstance(part, Rows):
            size = part.starts.shape[0] * part.per_row
            positions = (part.starts[:, None] + torch.arange(part.per_row, device=device)).flatten()
            offsets = part.offsets[:, None].expand(-1, part.per_row).flatten()
        else:
            size = part.size or total - begin
            positions = part.start + torch.arange(size, device=device)
            offsets = part.offset
        spans.append(_Span(part, begin, begin + size, positions, positions + offsets))
        begin += size
    assert begin == total, f"the parts cover {begin} tokens of {total}"
    return spans


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
                spans: list[_Span]) -> Tensor:
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
                k_cache: Tensor, v_cache: Tensor, span: _Span) -> Tensor:
        """One part's attention → [size, q_size]. `Rows`: the decode attention, each query reading its row
        in place up to its own position. `Prefill`: SDPA over the row's keys up to its end, causal aligned
        to the last key (flash takes it as it is, grouped KV heads included). `Chunk`: the decode attention over
        its row in place, each query up to its own position (positions given as tensors, so graphable)."""
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
            return self.kernels.decode_attention(q.flatten(0, 1), k_cache, v_cache, span.positions + 1, part.kv_len,
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
        k_cache[part.row, :, span.positions] = k[0]
        v_cache[part.row, :, span.positions] = v[0]
        return self.kernels.decode_attention(q[0], k_cache, v_cache, span.positions + 1, part.kv_len, tokens=size,
                                             row=part.row)


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
                k_cache: Tensor, v_cache: Tensor, spans: list[_Span]) -> tuple[Tensor, Tensor]:
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
        spans = _spans(parts, x.shape[1], x.device)
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
