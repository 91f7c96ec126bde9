"""Rotary position tables (RoPE and its scalings, Qwen v1's dynamic NTK and logn, M-RoPE's sections)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline.llm.weights.config import DecoderConfig


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

