"""GGUF's weight encodings, dequantized: every type the `gguf` package (llama.cpp's own) dequantizes.

The types most files are made of (F32/F16/BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) run here with torch:
a whole tensor as a few vectorised ops, where `gguf.quants.dequantize` is numpy on one CPU core; the tests
hold them to the package's results. Every other type (Q5_0, Q5_1, Q2_K, Q3_K, the IQ and ternary types:
what K-quant mixes use for rows that are not a multiple of 256, and the IQ mixes) is the package's own.

Block layouts, from ggml's `ggml-common.h` (32 weights a block; the K-quants 256, in 8 sub-blocks):
  Q8_0  d f16, q int8[32]                               w = d·q
  Q4_0  d f16, q nibbles[16]                            w = d·(q − 8)
  Q4_1  d f16, m f16, q nibbles[16]                     w = d·q + m
        (byte i holds weight i in its low nibble and weight i + 16 in its high one)
  Q4_K  d, dmin f16, 12 bytes of 6-bit sub-scales and mins, q nibbles[128]
        w = d·sc_s·q − dmin·m_s; 64 weights a run of 32 bytes: low nibbles sub-block 2j, high 2j + 1
  Q5_K  as Q4_K with a fifth bit per weight in qh[32] (bit 2j for run j's low half, 2j + 1 the high)
  Q6_K  ql[128] low 4 bits, qh[64] high 2 bits, scales int8[16], d f16     w = d·sc·(q − 32)
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

# type name → (weights per block, bytes per block), of the types dequantized here
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


@functools.cache
def supported() -> tuple[str, ...]:
    """Every type name this app loads: its own, and each one the installed `gguf` package dequantizes
    (tried once on a block of zeros: the package raises NotImplementedError for the rest)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as reference

    found = list(BLOCKS)
    for kind, (_, block_bytes) in GGML_QUANT_SIZES.items():
        if kind.name in found:
            continue
        try:
            reference(np.zeros((1, block_bytes), np.uint8), GGMLQuantizationType[kind.name])
        except NotImplementedError:
            continue
        found.append(kind.name)
    return tuple(found)


def _f16(raw: Tensor) -> Tensor:
    """Little-endian float16 from byte pairs [blocks, 2] → float32 [blocks, 1]."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> tuple[Tensor, Tensor]:
    return (qs & 15).float(), (qs >> 4).float()


def _k_scales(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 12 bytes → 8 six-bit scales and 8 six-bit mins per super-block."""
    s = scales.long()
    low, high = s[:, :4], s[:, 4:8]
    top = s[:, 8:]
    sc = torch.cat([low & 63, (top & 15) | ((low >> 6) << 4)], 1)
    mn = torch.cat([high & 63, (top >> 4) | ((high >> 6) << 4)], 1)
    return sc.float(), mn.float()


def _q8_0(b: Tensor) -> Tensor:
    return _f16(b[:, :2]) * b[:, 2:].view(torch.int8).float()


def _q4_0(b: Tensor) -> Tensor:
    lo, hi = _nibbles(b[:, 2:])
    return _f16(b[:, :2]) * (torch.cat([lo, hi], 1) - 8)


def _q4_1(b: Tensor) -> Tensor:
    lo, hi = _nibbles(b[:, 4:])
    return _f16(b[:, :2]) * torch.cat([lo, hi], 1) + _f16(b[:, 2:4])


def _k_quant(b: Tensor, q: Tensor) -> Tensor:
    """The K-quants' common tail: q [blocks, 8, 32] values of the eight sub-blocks → weights."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).flatten(1)


def _q4_k(b: Tensor) -> Tensor:
    lo, hi = _nibbles(b[:, 16:].view(-1, 4, 32))
    return _k_quant(b, torch.stack([lo, hi], 2).view(-1, 8, 32))


def _q5_k(b: Tensor) -> Tensor:
    qh = b[:, 16:48].long()
    lo, hi = _nibbles(b[:, 48:].view(-1, 4, 32))
    bits = torch.stack([(qh >> i) & 1 for i in range(8)], 1).float()  # [blocks, 8 sub-blocks, 32]
    return _k_quant(b, torch.stack([lo, hi], 2).view(-1, 8, 32) + 16 * bits)


def _q6_k(b: Tensor) -> Tensor:
    ql, qh = b[:, :128].long().view(-1, 2, 64), b[:, 128:192].long().view(-1, 2, 32)
    sc = b[:, 192:208].view(torch.int8).float().view(-1, 2, 8)
    d = _f16(b[:, 208:210])
    low = torch.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], 2)
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2)
    q = (low | (high << 4)).float() - 32  # [blocks, half, 4 quarters, 32]
    scale = sc.view(-1, 2, 4, 2)  # per 16 weights: quarter k of a half uses scales 2k, 2k + 1
    q = q.view(-1, 2, 4, 2, 16) * scale[..., None]
    return d * q.flatten(1)


DEQUANTIZE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw: Tensor, kind: str, shape: tuple[int, ...]) -> Tensor:
    """uint8 bytes of a GGUF tensor of type `kind` → float32 of `shape` (rows last-dimension-major, as
    GGUF stores them: `shape` is [rows, columns] for a matrix)."""
    raw = raw.reshape(-1)
    if kind == "F32":
        return raw.view(torch.float32).reshape(shape).clone()
    if kind == "F16":
        return raw.view(torch.float16).float().reshape(shape)
    if kind == "BF16":
        return raw.view(torch.bfloat16).float().reshape(shape)
    if kind in DEQUANTIZE:
        per_block, nbytes = BLOCKS[kind]
        return DEQUANTIZE[kind](raw.view(-1, nbytes)).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference

    values = reference(raw.cpu().numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(values.astype(np.float32, copy=False)).reshape(shape).to(raw.device)
