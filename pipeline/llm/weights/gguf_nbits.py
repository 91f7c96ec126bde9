"""A GGUF file's quantized matrices as ONNX Runtime's `MatMulNBits` operands, nothing re-rounded.

Why: on the CPU the app runs a GGUF file's decoder as one ONNX Runtime graph (`engine_builder/gguf_onnx.py`)
whose matrix products are `MatMulNBits` (com.microsoft): weights of 4 or 8 bits in blocks of 16 or 32, each
block `w = (q − zero)·scale`, computed by MLAS's kernels that dequantize as they go (int8 activations,
vectorized, multithreaded), as llama.cpp's do. Every GGUF block type is that shape, up to an offset per
block: w = scale·(q − zero) + offset. The offset (Q4_1, Q5_1, Q4_K, Q5_K: `d·q + m`, `d·sc·q − dmin·m`) is
not a whole zero point, so it is kept apart, [blocks, N], and added as (each block's sum of the input) ·
offset: the same sum, exactly.

Each type, by sub-block of its blocks (`plugins.gguf_blocks` reads the fields):
  Q4_0  32 · 4 bits, scale d, zero 8        Q4_1  32 · 4 bits, scale d, zero 0, offset m
  Q5_0  32 · 8 bits, scale d, zero 16       Q5_1  32 · 8 bits, scale d, zero 0, offset m
  Q8_0  32 · 8 bits (q + 128), zero 128     Q4_K  32 · 4 bits, scale d·sc, zero 0, offset −dmin·mn
  Q5_K  32 · 8 bits, as Q4_K                Q6_K  16 · 8 bits, scale d·sc, zero 32
(5- and 6-bit quants take 8 bits: MatMulNBits has no 5 or 6.) A weight's quant is gathered from its
block's low bits (`ql`) and high bits (`qh`) by per-position tables, one line per type (`QUANTS`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from plugins.gguf_blocks import repack


@dataclasses.dataclass(frozen=True)
class Quants:
    """Where weight j of a block finds its quant: (ql[low_index[j]] >> low_shift[j]) & low_mask, and, with
    `high_bits`, (qh[high_index[j]] >> high_shift[j]) & (2^high_bits − 1) above it."""

    low_index: list[int]
    low_shift: list[int]
    low_bits: int
    high_index: list[int] = ()
    high_shift: list[int] = ()
    high_bits: int = 0


def _nibbles(j: int) -> tuple[int, int]:
    """Q4_0's layout (and Q4_1/Q5_x's): weight j < 16 the low nibble of byte j, j ≥ 16 the high one of j − 16."""
    return j % 16, 4 * (j // 16)


def _k_nibbles(j: int) -> tuple[int, int]:
    """Q4_K/Q5_K's: sub-block s = j // 32 reads bytes 32·(s // 2)…, low nibbles for even s, high for odd."""
    s = j // 32
    return 32 * (s // 2) + j % 32, 4 * (s % 2)


def _tables(size: int, low, high=None) -> tuple[list[int], ...]:
    lows = [low(j) for j in range(size)]
    highs = [high(j) for j in range(size)] if high else []
    return [i for i, _ in lows], [s for _, s in lows], [i for i, _ in highs], [s for _, s in highs]


def _quants(size: int, low, low_bits: int, high=None, high_bits: int = 0) -> Quants:
    li, ls, hi, hs = _tables(size, low, high)
    return Quants(li, ls, low_bits, hi, hs, high_bits)


QUANTS = {
    "Q4_0": _quants(32, _nibbles, 4),
    "Q4_1": _quants(32, _nibbles, 4),
    "Q5_0": _quants(32, _nibbles, 4, lambda j: (j // 8, j % 8), 1),
    "Q5_1": _quants(32, _nibbles, 4, lambda j: (j // 8, j % 8), 1),
    "Q8_0": _quants(32, lambda j: (j, 0), 8),
    "Q4_K": _quants(256, _k_nibbles, 4),
    "Q5_K": _quants(256, _k_nibbles, 4, lambda j: (j % 32, j // 32), 1),
    # Q6_K: weight j of each 128 (h = j // 128, i = j % 128): ql[64h + i % 64] >> 4·(i // 64), qh[32h + i % 32] >> 2·(i // 32)
    "Q6_K": _quants(256, lambda j: (64 * (j // 128) + j % 64, 4 * (j % 128 // 64)), 4,
                    lambda j: (32 * (j // 128) + j % 32, 2 * (j % 128 // 32)), 2),
}
KINDS = frozenset(QUANTS)
SUB_BLOCK = {"Q6_K": 16}  # weights per MatMulNBits block: 32 for the others


@dataclasses.dataclass
class NBits:
    """One matrix [N, K] as MatMulNBits operands: `q` uint8 [N, K/block, block·bits/8] (4 bits: two a byte,
    the lower index in the low nibble); `scales` float32 [N·K/block]; `zeros` uint8 (4 bits: two blocks a
    byte; None: the operator's default, 2^(bits−1)); `offsets` float32 [K/block, N] or None."""

    bits: int
    block: int
    q: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    offsets: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * self.block

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.scales, self.zeros, self.offsets) if a is not None)

    def dequantize(self) -> Tensor:
        """The matrix in float32 [N, K], as the operator reads it (for the tests)."""
        n, k = self.shape
        q = torch.from_numpy(self.q).reshape(n, k // self.block, -1)
        if self.bits == 4:
            q = torch.stack([q & 15, q >> 4], -1).reshape(n, k // self.block, self.block)
        zeros = torch.full((n, k // self.block), 2 ** (self.bits - 1), dtype=torch.float32)
        if self.zeros is not None:
            z = torch.from_numpy(self.zeros).reshape(n, -1)
            zeros = (torch.stack([z & 15, z >> 4], -1).reshape(n, -1) if self.bits == 4 else z)[:, :k // self.block].float()
        w = (q.float() - zeros[..., None]) * torch.from_numpy(self.scales).reshape(n, -1, 1)
        if self.offsets is not None:
            w = w + torch.from_numpy(self.offsets).T[..., None]
        return w.reshape(n, k)


def _quant_values(planes: dict[str, Tensor], kind: str) -> Tensor:
    """The quants 0..2^bits−1 [chunks, rows, block size], uint8."""
    table = QUANTS[kind]
    q = (planes["qs"].view(torch.uint8)[..., table.low_index] >> torch.tensor(table.low_shift, dtype=torch.uint8)) \
        & (2 ** table.low_bits - 1)
    if table.high_bits:
        high = (planes["qh"][..., table.high_index] >> torch.tensor(table.high_shift, dtype=torch.uint8)) \
            & (2 ** table.high_bits - 1)
        q = q | (high << table.low_bits)
    return q ^ 0x80 if kind == "Q8_0" else q  # Q8_0's int8 as offset binary: q + 128


def _scales(planes: dict[str, Tensor], kind: str) -> tuple[Tensor, Tensor | None, int, int | None]:
    """Each sub-block's scale and offset [chunks, rows, sub-blocks] (offset None: none), the bits the
    quants take, and the zero point (None: 0)."""
    d = planes["d"].float()[..., None]
    if kind in ("Q4_0", "Q5_0", "Q8_0"):
        return d, None, 4 if kind == "Q4_0" else 8, {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}[kind]
    if kind in ("Q4_1", "Q5_1"):
        return d, planes["m"].float()[..., None], 4 if kind == "Q4_1" else 8, None
    if kind == "Q6_K":
        return d * planes["sc"].float(), None, 8, 32
    return d * planes["sc"].float(), -(planes["m"].float()[..., None] * planes["mn"].float()), \
        4 if kind == "Q4_K" else 8, None


def from_gguf(raw: Tensor, kind: str, in_features: int) -> NBits:
    """A matrix's stored bytes, uint8 [rows, row bytes] (on the CPU), of GGUF type `kind` (one of `KINDS`)."""
    planes = repack(raw, kind)
    rows, block = raw.shape[0], SUB_BLOCK.get(kind, 32)
    q = _quant_values(planes, kind).transpose(0, 1).reshape(rows, in_features // block, block)  # [N, blocks, block]
    scale, offset, bits, zero = _scales(planes, kind)
    scales = scale.transpose(0, 1).reshape(rows, -1)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    zeros = None
    if zero is None or zero != 2 ** (bits - 1):  # the operator's default zero point needs no input
        per_row = -(-scales.shape[1] // 2) if bits == 4 else scales.shape[1]
        zeros = torch.full((rows, per_row), (zero or 0) * (17 if bits == 4 else 1), dtype=torch.uint8)
    offsets = None if offset is None else offset.transpose(0, 1).reshape(rows, -1).T.contiguous()
    return NBits(bits, block, q.contiguous().numpy(), scales.contiguous().reshape(-1).numpy(),
                 None if zeros is None else zeros.reshape(-1).numpy(), None if offsets is None else offsets.numpy())



def to_blocks(weight: Tensor, kind: str) -> Tensor:
    """A float matrix [rows, cols] rounded to GGUF blocks of `kind` (gguf-py's quantizer, as llama.cpp's)
    → its bytes [rows, row bytes]: how a float checkpoint's decoder takes the same engine as a GGUF file's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return torch.from_numpy(quantize(weight.float().numpy(), GGMLQuantizationType[kind]))
