"""A checkpoint folder's weights in a `Decoder`: `weights/` reads the tensors and renames them to the
decoder's names, this puts them into one. It sits in the model layer, beside `decoder.py`, not in `weights/`, so the
weights layer never imports the decoder it is loaded into (text → weights → model → engine).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from pipeline.errors import UserError
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.weights.checkpoint import (StateDict, layout_of, read_config, read_gguf_as_stored, read_tensors,
                                             take, to_internal)
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.weights.families import Layout
from pipeline.llm.weights.prequantized import prequantized_weights
from pipeline.llm.weights.gguf_native import KINDS, GGUFEmbedding, GGUFLinear
from pipeline.llm.weights.quant import QUANTIZED, empty_quantized
from plugins.gguf_matmul import GGUFWeight
from plugins.lowbit import Workspace


class _Unfilled(TorchFunctionMode):
    """`nn.init`'s fills skipped (this thread only: torch's modes are per thread). On the meta device they
    fill nothing, yet their first call imported torch's compiler (torch._dynamo and sympy: 4.6 s of a second
    launch's load on an H200 machine, 2026-11-29)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", "") == "torch.nn.init" or func in (torch.Tensor.uniform_, torch.Tensor.normal_):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def empty_decoder(config: DecoderConfig, dtype: torch.dtype | None = None) -> Decoder:
    """The decoder's structure on the meta device, in `dtype` (its own where None): shapes, no values."""
    with torch.device("meta"), _Unfilled():
        model = Decoder(config)
        return model.to(dtype) if dtype is not None else model


def build_decoder(config: DecoderConfig, sd: StateDict, dtype: torch.dtype, device: str | torch.device,
                  mode: str = "none") -> Decoder:
    """The decoder holding `sd` (its own names; under `mode` int8/int4 the quantized layers' buffers, as
    `quant.empty_quantized` lays them out; a tied LM head may be left out)."""
    model = empty_decoder(config, dtype)
    if mode != "none":
        with torch.device("meta"):
            empty_quantized(model, mode)
    if config.tie_word_embeddings:
        sd["lm_head.weight"] = sd["embed.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.to(device).eval()


def load_decoder(folder: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Decoder:
    """Build the decoder for a checkpoint folder of any supported format, weights in `dtype` on `device`."""
    folder = Path(folder)
    config = read_config(folder)
    if config.quantization:
        raise UserError(f"{folder.name} holds {config.quantization.upper()} int4 weights: it loads as int4 "
                        f"(`quantized_weights.quantized_decoder`), not as float weights")
    return decoder_from(folder, config, layout_of(config), dtype, device)


def decoder_from(folder: Path, config: DecoderConfig, layout: Layout, dtype: torch.dtype,
                 device: str | torch.device) -> Decoder:
    """The decoder whose tensors the folder's weight files hold under `layout`'s names (a VLM's decoder
    beside its vision tensors, which are left aside)."""
    return build_decoder(config, to_internal(config, read_tensors(Path(folder), dtype), layout), dtype, device)


def load_prequantized(folder: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> Decoder:
    """The decoder of an AWQ/GPTQ folder (`prequantized.prequantized_weights`): int4 block projections,
    an int8 LM head, floats in `dtype`."""
    config, sd = prequantized_weights(folder, dtype)
    return build_decoder(config, sd, dtype, device, "int4")


def gguf_as_stored(folder: Path, dtype: torch.dtype, kept: frozenset[str]) -> tuple[DecoderConfig, StateDict,
                                                                                    str | None, str | None]:
    """A GGUF folder's config and tensors under the decoder's names, its matrices of the types in `kept` as
    stored: each block projection as f"layers.N.{path}.matrices", a list of (bytes uint8 [rows, row bytes],
    type) or (floats, None) in output order; and the types of its embedding and of its LM head (None: float)."""
    folder = Path(folder)
    config = read_config(folder)
    raw, kinds = read_gguf_as_stored(folder, dtype, kept)
    layout = layout_of(config)
    head_kind = kinds.get(layout.embed) if config.tie_word_embeddings else kinds.get("lm_head.weight")

    def stored(tensors: StateDict, modules: list[str]) -> dict:
        return {"matrices": [(take(tensors, m + "weight"), kinds.get(m + "weight")) for m in modules]}

    return config, to_internal(config, raw, layout, stored), kinds.get(layout.embed), head_kind


def load_gguf_native(folder: Path, dtype: torch.dtype, device: torch.device) -> Decoder:
    """The decoder of a GGUF model folder with its matrices as the file stores them (`gguf_native.py`): the
    four projections of every block, the LM head and the embedding on the GGUF kernels, read from the file
    without dequantizing; norms, biases and any float matrix in `dtype`. Each matrix goes to `device`
    as it is placed, so the host holds the file's bytes once and the GPU its blocks once."""
    folder = Path(folder)
    config, sd, embed_kind, head_kind = gguf_as_stored(folder, dtype, KINDS)
    workspace = Workspace(device)
    model = empty_decoder(config, dtype)
    for i, block in enumerate(model.layers):
        for path in QUANTIZED:
            parent, attr = path.split(".")
            meta = getattr(getattr(block, parent), attr)
            matrices = [(m.to(device), kind) for m, kind in sd.pop(f"layers.{i}.{path}.matrices")]
            bias = sd.pop(f"layers.{i}.{path}.bias", None)
            setattr(getattr(block, parent), attr, GGUFLinear.from_matrices(
                matrices, meta.in_features, None if bias is None else bias.to(device), workspace,
                gate_up=path == "mlp.w_gate_up"))
    hidden = config.hidden_size
    if embed_kind is not None:
        table = GGUFWeight.from_raw(sd.pop("embed.weight").to(device), embed_kind, hidden, None, workspace)
        model.embed = GGUFEmbedding(table, dtype)
        if config.tie_word_embeddings:
            model.lm_head = GGUFLinear([table], None)
            sd.pop("lm_head.weight")
    if head_kind is not None and not config.tie_word_embeddings:
        model.lm_head = GGUFLinear.from_matrices([(sd.pop("lm_head.weight").to(device), head_kind)], hidden, None,
                                                 workspace)
    model.load_state_dict(sd, strict=False, assign=True)
    if config.tie_word_embeddings and embed_kind is None:
        model.lm_head.weight = model.embed.weight
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise UserError(f"{folder.name}: the GGUF file gave no value for {', '.join(left[:3])}")
    return model.to(device).eval()
