"""Pre-quantized int4 checkpoints (AWQ and GPTQ folders, as Qwen, TheBloke and others publish them),
repacked into the app's own int4 format (`quant.py`).

Why repack rather than run their kernels: both formats hold the arithmetic ours does, w = (q − z)·s
per group of 128 inputs, and differ only in how the integers are packed. Unpacking once at load (the
result is cached like our own quantized weights, `quantized_weights.py`) leaves one int4 format, one
kernel path and one reference for every int4 model, and the rest of the app unchanged.

On disk (int32 words of eight 4-bit values, the first in the lowest bits; scales [in/group, out]):
  AWQ GEMM  qweight [in, out/8] and qzeros [in/group, out/8], packed along the outputs with AutoAWQ's
            interleave: nibble k of a word holds output AWQ_ORDER[k] of its eight.
  GPTQ      qweight [in/8, out] packed along the inputs, qzeros [in/group, out/8] along the outputs,
            both in order; g_idx [in], each input's group. checkpoint_format "gptq" (AutoGPTQ's, the
            default) stores zero − 1, "gptq_v2" (GPTQModel's) the zero itself.
Embeddings, norms, biases and the LM head are float in both; the head is made int8 as `--quant` does.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from pipeline.errors import UserError
from pipeline.llm.weights.checkpoint import StateDict, layout_of, read_config, read_tensors, take, to_internal
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.weights.quant import GROUP, HEAD_MODE, pack_int4, quantize
from pipeline.llm.weights.quant_config import Scheme, scheme_of
from pipeline.weights_io import read_json

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output (of 8) each nibble of an AWQ word holds
IN_ORDER = tuple(range(8))  # GPTQ's packing
def _unpack(words: Tensor, order: tuple[int, ...]) -> Tensor:
    """int32 [..., n] → uint8 [..., 8n], the values in output order (value j lies in nibble order.index(j))."""
    nibble = torch.tensor([order.index(j) for j in range(8)], dtype=torch.int32)
    return ((words[..., None] >> 4 * nibble) & 15).flatten(-2).to(torch.uint8)


def _module(raw: StateDict, module: str, scheme: Scheme) -> tuple[Tensor, Tensor, Tensor]:
    """One checkpoint linear (consumed from `raw`): q uint8 [out, in], zero and scale [out, in/GROUP]."""
    qweight, qzeros, scales = (take(raw, module + name) for name in ("qweight", "qzeros", "scales"))
    order = AWQ_ORDER if scheme.method == "awq" else IN_ORDER
    q = _unpack(qweight, order).T if scheme.method == "awq" else _unpack(qweight.T, order)
    zero = _unpack(qzeros, order).T.float() + scheme.zero_offset  # GPTQ v1's stored 15 is a zero of 16
    out, n = q.shape
    # `quant.group_size(n)` is GROUP for these widths: the app's int4 layout is then the checkpoint's
    if n % GROUP or scales.shape != (n // GROUP, out) or zero.shape != (out, n // GROUP):
        raise UserError(f"{module}qweight/qzeros/scales have shapes {list(qweight.shape)}/{list(qzeros.shape)}/"
                        f"{list(scales.shape)}, not a {scheme.method.upper()} layout in groups of {GROUP}: "
                        f"a damaged or differently packed checkpoint")
    g_idx = raw.pop(module + "g_idx", None)
    if (scheme.desc_act and g_idx is None) or (
            g_idx is not None and not torch.equal(g_idx.long(), torch.arange(n) // GROUP)):
        raise UserError(f"{module}g_idx: this GPTQ checkpoint was quantized with desc_act (act-order), whose groups "
                        f"are not runs of {GROUP} inputs; the int4 kernels here cannot run it: take a variant made "
                        f"with desc_act false, or the float checkpoint with --quant int4")
    return q, zero, scales.T


def _linear(raw: StateDict, modules: list[str], scheme: Scheme, dtype: torch.dtype) -> StateDict:
    """One of our projections in the app's int4 format, from its checkpoint modules (q, k, v: three)."""
    q, zero, scale = (torch.cat(parts) for parts in zip(*(_module(raw, m, scheme) for m in modules)))
    return {"q": pack_int4(q), "scale": scale.to(dtype), "zero": zero.to(dtype)}


def prequantized_weights(folder: Path, dtype: torch.dtype) -> tuple[DecoderConfig, StateDict]:
    """An AWQ/GPTQ folder's config and tensors under the decoder's names: int4 block projections and an
    int8 LM head (a tied head stays float), laid out as `quantized_weights.load_quantized`'s, floats in
    `dtype` (`loading.load_prequantized` puts them into a decoder)."""
    folder = Path(folder)
    config = read_config(folder)
    scheme = scheme_of(read_json(folder / "config.json")["quantization_config"])
    linear = functools.partial(_linear, scheme=scheme, dtype=dtype)
    sd = to_internal(config, read_tensors(folder, dtype), layout_of(config), linear)
    if not config.tie_word_embeddings:  # the head `quant.quantized_layers` names, in its mode
        sd.update({f"lm_head.{k}": v for k, v in quantize(sd.pop("lm_head.weight"), HEAD_MODE, dtype).items()})
    return config, sd
