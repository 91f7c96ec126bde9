"""A checkpoint folder's weights in a `Decoder`: `weights/` reads the tensors and renames them to the
decoder's names, this puts them into one. It sits beside `model.py`, not in `weights/`, so the
weights layer never imports the decoder it is loaded into (text → weights → model → engine).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.llm.model import Decoder
from pipeline.llm.weights.checkpoint import StateDict, layout_of, read_config, read_tensors, to_internal
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.weights.families import Layout
from pipeline.llm.weights.prequantized import prequantized_weights
from pipeline.llm.weights.quant import empty_quantized


def build_decoder(config: DecoderConfig, sd: StateDict, dtype: torch.dtype, device: str | torch.device,
                  mode: str = "none") -> Decoder:
    """The decoder holding `sd` (its own names; under `mode` int8/int4 the quantized layers' buffers, as
    `quant.empty_quantized` lays them out; a tied LM head may be left out)."""
    with torch.device("meta"):
        model = Decoder(config).to(dtype)
        if mode != "none":
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
