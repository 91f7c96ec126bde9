"""GGUF's quantized block formats as plain data, and their repacking for the kernels (`plugins.gguf_matmul`).

A GGUF file stores a weight row as blocks: 32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or super-blocks of
256 (the K types) with their scales inside. The kernels read the same bits, laid out as planes: each
field of a block (the low 4 bits of the weights, their high bits, the 6-bit sub-scales decoded to bytes,
the fp16 scales) in its own tensor [chunks, rows, field bytes], so that a program reading a run of output
rows at one chunk reads one contiguous run of each plane (the file's rows of whole blocks would make it
hop by a row's length). Nothing is re-rounded: the planes hold the file's bits, plus the K types' sub-scales
and mins as whole bytes (12 packed bytes become 16: Q4_K takes 148 bytes per 256 weights where the file
takes 144). Repacking is a few tensor reshapes per matrix, done where the bytes are (the GPU), at load.

Layouts, from llama.cpp's `ggml-common.h` (and gguf-py's `quants.py`, whose dequantization the kernels
match bit for bit, `tests/test_gguf_kernels.py`):
  Q4_0  d f16 · qs[16]: weight j < 16 is the low nibble of qs[j], j ≥ 16 the high one;    d·(q − 8)
  Q4_1  d, m f16 · qs[16] as Q4_0;                                                        d·q + m
  Q5_0  d f16 · qh u32 (bit j: weight j's fifth bit) · qs[16] as Q4_0;                    d·(q − 16)
  Q5_1  d, m f16 · qh · qs[16];                                                           d·q + m
  Q8_0  d f16 · qs int8[32];                                                              d·q
  Q4_K  d, dmin f16 · scales[12] (eight 6-bit scales and mins) · qs[128]: sub-block s of 32 weights is the
        low (s even) or high (s odd) nibbles of qs[32·(s//2) …];                          d·sc[s]·q − dmin·m[s]
  Q5_K  as Q4_K, with qh[32] (bit s of qh[j]: sub-block s's weight j's fifth bit) before qs
  Q6_K  ql[128] · qh[64] · scales int8[16] · d f16: weight j of each 128 (h = j // 128, i = j % 128) is
        ql[64h + i % 64] >> 4·(i // 64) (4 bits) and qh[32h + i % 32] >> 2·(i // 32) (2 bits);
        sub-block s of 16 weights has scale sc[s];                                        d·sc[s]·(q − 32)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """One GGUF type: weights per block (`size`), its bytes, and where its fields sit (name → (offset, bytes));
    `code` is the kernels' constant for it."""

    code: int
    size: int
    nbytes: int
    fields: dict[str, tuple[int, int]]


FORMATS = {
    "Q4_0": BlockFormat(0, 32, 18, {"d": (0, 2), "qs": (2, 16)}),
    "Q4_1": BlockFormat(1, 32, 20, {"d": (0, 2), "m": (2, 2), "qs": (4, 16)}),
    "Q5_0": BlockFormat(2, 32, 22, {"d": (0, 2), "qh": (2, 4), "qs": (6, 16)}),
    "Q5_1": BlockFormat(3, 32, 24, {"d": (0, 2), "m": (2, 2), "qh": (4, 4), "qs": (8, 16)}),
    "Q8_0": BlockFormat(4, 32, 34, {"d": (0, 2), "qs": (2, 32)}),
    "Q4_K": BlockFormat(5, 256, 144, {"d": (0, 2), "m": (2, 2), "scales": (4, 12), "qs": (16, 128)}),
    "Q5_K": BlockFormat(6, 256, 176, {"d": (0, 2), "m": (2, 2), "scales": (4, 12), "qh": (16, 32),
                                      "qs": (48, 128)}),
    "Q6_K": BlockFormat(7, 256, 210, {"qs": (0, 128), "qh": (128, 64), "sc": (192, 16), "d": (208, 2)}),
}
PLANES = ("qs", "qh", "sc", "mn", "d", "m")  # the kernels' planes, in their argument order


def _k_scales(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The K types' 12 bytes [..., 12] → eight 6-bit scales and eight 6-bit mins, uint8 [..., 8] each: bytes
    0–3 hold scales 0–3 (low 6 bits) and the top bits of scales 4–7, bytes 4–7 the mins likewise, bytes
    8–11 the low 4 bits of scales 4–7 (low nibble) and mins 4–7 (high nibble)."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return scales, mins


def repack(raw: Tensor, kind: str) -> dict[str, Tensor]:
    """A matrix's stored bytes, uint8 [rows, row bytes] (whole blocks), → its planes, each [chunks, rows, …]
    (`PLANES`: fp16 scales [chunks, rows]; Q6_K's sub-scales int8), made where `raw` is."""
    fmt = FORMATS[kind]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, fmt.nbytes).transpose(0, 1)  # [chunks, rows, block bytes]

    def field(name: str) -> Tensor:
        offset, size = fmt.fields[name]
        return blocks[..., offset:offset + size].contiguous()

    planes = {"qs": field("qs"), "d": field("d").view(torch.float16)[..., 0]}
    if "m" in fmt.fields:
        planes["m"] = field("m").view(torch.float16)[..., 0]
    if "qh" in fmt.fields:
        planes["qh"] = field("qh")
    if "scales" in fmt.fields:
        planes["sc"], planes["mn"] = (t.contiguous() for t in _k_scales(field("scales")))
    if kind == "Q6_K":
        planes["sc"] = field("sc").view(torch.int8)
    if kind == "Q8_0":
        planes["qs"] = planes["qs"].view(torch.int8)
    return planes


def nbytes(planes: dict[str, Tensor]) -> int:
    """What a repacked matrix takes in memory."""
    return sum(t.numel() * t.element_size() for t in planes.values())


def row_bytes(kind: str, width: int) -> int:
    """A stored row of `width` weights, in bytes."""
    fmt = FORMATS[kind]
    return width // fmt.size * fmt.nbytes
