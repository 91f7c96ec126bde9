"""One decoder-only transformer for Qwen v1, Qwen2/2.5, Qwen3 and LLaMA/Vicuna.

gpt-fast style: plain modules, fused q/k/v and gate/up projections (one GEMM each instead of three
and two). Family differences are switches on `DecoderConfig`: qkv bias, qk-norm, GQA, and Qwen v1's
logn scaling and dynamic NTK. The model holds weights only: the KV cache and the rotary tables
belong to the engine that schedules requests (`pipeline/llm/engine/torch_engine.py`) and come in as arguments,
with a `Prefill` (one request's new tokens into one cache row) or a `Decode` (one token for each of
the cache's first B rows, each at its own position).

State-dict names (the loaders map every checkpoint format onto these):
  embed.weight · layers.N.attn_norm.weight · layers.N.attn.wqkv.{weight,bias}
  layers.N.attn.{q_norm,k_norm}.weight · layers.N.attn.wo.weight · layers.N.mlp_norm.weight
  layers.N.mlp.w_gate_up.weight ([gate; up]) · layers.N.mlp.w_down.weight · norm.weight · lm_head.weight
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import CausalBias, causal_lower_right

from pipeline.llm.weights.config import DecoderConfig
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
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
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
    """Position tables for sequences up to `max_seq`: cos/sin [tables, max_seq, head_dim].

    Most models have one table. Qwen v1's dynamic NTK picks the RoPE base from the prompt length
    at prefill (alpha 1, 3, 7, … per doubling past `seq_length`) and keeps it while decoding, so
    requests of different lengths use different tables: one per alpha, indexed per row.
    """

    def __init__(self, config: DecoderConfig, max_seq: int, device):
        c = config
        self.config = config
        self.alphas = [1.0]
        if c.dynamic_ntk:
            while self.alphas[-1] < qwen_ntk_alpha(max_seq, c.seq_length):
                self.alphas.append(self.alphas[-1] * 2 + 1)
        tables = [rope_tables(c.head_dim, max_seq, c.rope_theta * a ** (c.head_dim / (c.head_dim - 2)), device,
                              c.rope_scaling) for a in self.alphas]
        self.cos = torch.stack([cos for cos, _ in tables])
        self.sin = torch.stack([sin for _, sin in tables])
        self.logn = qwen_logn_scale(max_seq, c.seq_length).to(device) if c.logn_attn else None

    def table_for(self, context_len: int) -> int:
        """Which table a prompt of `context_len` tokens uses (always 0 without dynamic NTK)."""
        if not self.config.dynamic_ntk:
            return 0
        return self.alphas.index(qwen_ntk_alpha(context_len, self.config.seq_length))


@dataclasses.dataclass(frozen=True)
class Prefill:
    """One request's tokens at positions start.. of cache row `row`; `table` picks its rotary table."""

    row: int
    start: int
    table: int = 0


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A prompt chunk of cache row `row` [1] at positions `start` [1].. with rotary table `table` [1],
    all tensors, attending to the row's first `kv_len` positions (a mask hides those past each query):
    its shapes stay the same from chunk to chunk, so a CUDA graph replays it. `positions` [T] are made
    by the decoder."""

    row: Tensor
    start: Tensor
    table: Tensor
    kv_len: int
    positions: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Decode:
    """One token for each cache row 0..B-1, at `positions` [B], with rotary `tables` [B]; attention
    reads at most the first `kv_len` positions of each row, and of row b its first positions[b] + 1
    (`lengths`, made once per step by the decoder)."""

    positions: Tensor
    tables: Tensor
    kv_len: int
    lengths: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Verify:
    """T tokens for each cache row 0..B-1 at positions starts[b]..starts[b]+T-1, rotary `tables` [B]:
    speculative decoding's check (a row's last token and the tokens drafted after it, scored in one
    step). The decode attention reads each row in place, each query up to its own position; `positions`
    [B, T] and `lengths` [B*T] are made by the decoder."""

    starts: Tensor
    tables: Tensor
    kv_len: int
    positions: Tensor | None = None
    lengths: Tensor | None = None


Step = Prefill | Chunk | Decode | Verify


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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, logn: Tensor | None, mask: CausalBias | Tensor | None,
                k_cache: Tensor, v_cache: Tensor, step: Step) -> Tensor:
        """`k_cache`/`v_cache` are this layer's [rows, kv_heads, max_seq, head_dim]. For a prefill, `mask`
        None means a fresh one (positions 0..T-1): plain causal attention; else the causal mask aligned
        to the last key (a chunk after cached positions), which SDPA's flash kernel takes as it is, grouped
        KV heads included. A `Chunk`'s mask is a boolean [T, kv_len] (positions given as tensors); a
        decode step masks by its rows' positions itself."""
        c = self.config
        bsz, seqlen, _ = x.shape
        q, k, v = self.wqkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(bsz, seqlen, c.num_heads, c.head_dim)
        k = k.view(bsz, seqlen, c.num_kv_heads, c.head_dim)
        v = v.view(bsz, seqlen, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(step, Prefill):
            q, k = self.kernels.rotary(q, cos, sin), self.kernels.rotary(k, cos, sin)
            end = step.start + seqlen
            k_cache[step.row, :, step.start:end] = k[0].transpose(0, 1)
            v_cache[step.row, :, step.start:end] = v[0].transpose(0, 1)
            keys, values = k_cache[step.row:step.row + 1, :, :end], v_cache[step.row:step.row + 1, :, :end]
        elif isinstance(step, Verify):
            q, k = self.kernels.rotary(q, cos, sin), self.kernels.rotary(k, cos, sin)
            rows = torch.arange(bsz, device=x.device)[:, None].expand(bsz, seqlen)
            k_cache[rows, :, step.positions] = k
            v_cache[rows, :, step.positions] = v
        elif isinstance(step, Chunk):
            q, k = self.kernels.rotary(q, cos, sin), self.kernels.rotary(k, cos, sin)
            k_cache[step.row, :, step.positions] = k[0]
            v_cache[step.row, :, step.positions] = v[0]
            keys = k_cache[:, :, :step.kv_len].index_select(0, step.row)
            values = v_cache[:, :, :step.kv_len].index_select(0, step.row)
            if logn is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
                return self.wo(_flash_chunk(q[0], keys[0], values[0], step).reshape(bsz, seqlen, c.q_size))
        else:
            q = self.kernels.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, step.positions)
        if logn is not None:
            q = q * logn[:, :, None, None].to(q.dtype)
        if isinstance(step, Decode | Verify):  # each query's own valid positions, read in place
            y = self.kernels.decode_attention(q.flatten(0, 1), k_cache, v_cache, step.lengths, step.kv_len,
                                              tokens=seqlen)
            return self.wo(y.view(bsz, seqlen, c.q_size))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=keys.shape[1] != c.num_heads)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, c.q_size))


def _flash_chunk(q: Tensor, keys: Tensor, values: Tensor, step: Chunk) -> Tensor:
    """A chunk's attention [T, heads, head_dim] by FlashAttention's variable-length kernel: the key count
    (the chunk's end) is read from the device, so the shapes stay fixed under a CUDA graph, and the
    causal mask is aligned to the last key, grouped KV heads read as they are (SDPA's flash takes no
    key count, and its masked kernels run several times slower here)."""
    seqlen, dev = q.shape[0], q.device
    cum_q = torch.arange(2, device=dev, dtype=torch.int32) * seqlen
    cum_k = torch.cat([torch.zeros(1, device=dev, dtype=torch.int32), (step.start + seqlen).to(torch.int32)])
    return torch.ops.aten._flash_attention_forward(q, keys.transpose(0, 1), values.transpose(0, 1), cum_q, cum_k,
                                                   seqlen, step.kv_len, 0.0, True, False,
                                                   scale=q.shape[-1] ** -0.5)[0]


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
                mask: CausalBias | None, k_cache: Tensor, v_cache: Tensor, step: Step) -> tuple[Tensor, Tensor]:
        """The residual stream is `x + delta`; returns the stream and this block's own delta (its MLP's
        output), left for the next norm to add: each add is fused into the norm that follows it."""
        x, h = self.attn_norm.add(x, delta)
        x, h = self.mlp_norm.add(x, self.attn(h, cos, sin, logn, mask, k_cache, v_cache, step))
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

    def forward(self, cache: KVCache, rope: RotaryTables, step: Step, tokens: Tensor | None = None,
                embeds: Tensor | None = None, last_only: bool = True, logits: bool = True,
                last: Tensor | None = None) -> Tensor | None:
        """Logits for `tokens` [B, T] (or ready-made `embeds` [B, T, hidden]) placed as `step` says.

        A `Prefill` or a `Chunk` is one row (B = 1) of T tokens; `last_only` skips the LM head for all
        but its last position, and `logits` False skips it altogether (a prompt chunk before the last
        only writes the cache). A `Decode` is one token (T = 1) for each of cache rows 0..B-1, a
        `Verify` T tokens for each of them (with `last_only` False: logits at every position).
        """
        x = self.embed(tokens) if embeds is None else embeds
        bsz, seqlen = x.shape[:2]
        if isinstance(step, Prefill):
            positions = torch.arange(step.start, step.start + seqlen, device=x.device)[None]
            cos, sin = rope.cos[step.table, positions], rope.sin[step.table, positions]
            mask = None if step.start == 0 else causal_lower_right(seqlen, step.start + seqlen)
        elif isinstance(step, Chunk):
            step = dataclasses.replace(step, positions=step.start + torch.arange(seqlen, device=x.device))
            positions = step.positions[None]
            cos, sin = rope.cos[step.table[:, None], positions], rope.sin[step.table[:, None], positions]
            mask = torch.arange(step.kv_len, device=x.device)[None] <= step.positions[:, None]
        elif isinstance(step, Verify):  # as many decode steps: each query masked by its own length
            positions = step.starts[:, None] + torch.arange(seqlen, device=x.device)
            step = dataclasses.replace(step, positions=positions, lengths=positions.flatten() + 1)
            cos, sin = rope.cos[step.tables[:, None], positions], rope.sin[step.tables[:, None], positions]
            mask = None
        else:  # the decode attention masks each row by its own length
            step = dataclasses.replace(step, lengths=step.positions + 1)
            positions = step.positions[:, None]
            cos, sin = rope.cos[step.tables[:, None], positions], rope.sin[step.tables[:, None], positions]
            mask = None
        logn = rope.logn[positions] if rope.logn is not None else None
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, cos, sin, logn, mask, cache.k[i], cache.v[i], step)
        if not logits:
            return None
        if last is not None:
            x, delta = x.index_select(1, last), delta.index_select(1, last)
        elif last_only:
            x, delta = x[:, -1:].contiguous(), delta[:, -1:].contiguous()
        return self.lm_head(self.norm.add(x, delta)[1])
