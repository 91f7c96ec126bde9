"""GGUF's weight encodings, dequantized by the `gguf` package (llama.cpp's own): every type it reads.

Why the package's and not our own: ours (torch, for F32/F16/BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)
ran at 0.08–0.71× its speed where the app dequantizes, on the CPU as the file is read
(bench/RESULTS.md, "GGUF dequantization"; the bench is in commit 9be2b70), and it reads every type llama.cpp's mixes use besides
(Q5_0, Q5_1, Q2_K, Q3_K, the IQ and ternary types: the fallbacks of rows that are not a multiple of 256).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor


@functools.cache
def supported() -> tuple[str, ...]:
    """Every type name the installed `gguf` package dequantizes (tried once on a block of zeros: it raises
    NotImplementedError for the rest, such as Q8_K, llama.cpp's scratch type)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as reference

    found = []
    for kind, (_, block_bytes) in GGML_QUANT_SIZES.items():
        try:
            reference(np.zeros((1, block_bytes), np.uint8), GGMLQuantizationType[kind.name])
        except NotImplementedError:
            continue
        found.append(kind.name)
    return tuple(found)


def dequantize(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> Tensor:
    """A GGUF tensor's data (as the reader gives it: bytes, or typed floats) of type `kind` (a `supported()`
    name) → float32 of `shape` (rows first, as `GGUFTensor.shape`), in memory of its own (not the file's)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference

    values = reference(np.ascontiguousarray(data).reshape(-1).view(np.uint8), GGMLQuantizationType[kind])
    return torch.from_numpy(np.array(values, np.float32)).reshape(shape)
