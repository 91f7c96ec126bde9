"""Quantized decoders, made once per checkpoint and kept in the engine cache.

Quantizing a 7B model means reading its 15 GB and rounding 7 billion weights; the result (at
Qwen2.5-7B 8.2 GB for int8, 5.1 GB for int4: the embedding stays float, the LM head is int8) is
written to the engine cache under a key holding the source weights' SHA-256, the mode, the group
size and this format's version, exactly as an engine is: the second launch reads it directly, a changed checkpoint is quantized again, and a
damaged or half-written file is never loaded (`engine_builder.cache`). A pre-quantized (AWQ/GPTQ)
folder is repacked instead of quantized (`prequantized.py`), always into int4, and cached the same way.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from engine_builder.cache import EngineCache, EngineKey
from engine_builder.fingerprint import fingerprint
from pipeline.llm.checkpoint import build_decoder, load_decoder, read_config
from pipeline.llm.model import Decoder
from pipeline.llm.prequantized import load_prequantized
from pipeline.llm.quant import GROUP, quantize_decoder
from pipeline.weights_io import read_weight_file

FORMAT = "2"  # bump when the stored layout of quantized weights changes (2: the LM head in int8)
FILE = "decoder.safetensors"


def quant_key(folder: Path, mode: str, dtype: torch.dtype, cache: EngineCache, method: str = "") -> EngineKey:
    """What a cached quantized decoder depends on: the weights, mode, group size, dtype and format
    (not the device: the stored tensors are the same for every GPU); `method` ("awq", "gptq"): the
    repacked weights of a pre-quantized checkpoint (`llm-int4-awq`)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return EngineKey(component=f"llm-{mode}" + (f"-{method}" if method else ""), source=str(Path(folder).resolve()),
                     weights=fingerprint([folder], cache.root), precision=f"{mode}/{dtype_name}",
                     profile={"group": GROUP} if mode == "int4" else {}, builder="studio-quant",
                     builder_version=FORMAT, device="any")


def quantize_checkpoint(folder: Path, mode: str, dtype: torch.dtype, device: torch.device) -> Decoder:
    """Read the float checkpoint on the CPU and quantize it layer by layer on `device` (a bar per layer)."""
    model = load_decoder(folder, dtype=dtype, device="cpu")
    bar = functools.partial(tqdm, desc=f"quantizing to {mode}", unit="layer", file=sys.stderr)
    return quantize_decoder(model, mode, device, bar).to(device)


def save_quantized(model: Decoder, path: Path) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]  # the same tensor as the embedding: safetensors stores it once
    save_file(state, str(path), metadata={"format": "pt"})


def load_quantized(folder: Path, path: Path, mode: str, dtype: torch.dtype, device: torch.device) -> Decoder:
    """A quantized decoder from a file `save_quantized` wrote."""
    return build_decoder(read_config(folder), read_weight_file(path, "quantized weights"), dtype, device, mode)


def quantized_decoder(folder: Path, mode: str, dtype: torch.dtype, device: torch.device,
                      cache: EngineCache | None, say: Callable[[str], None]) -> Decoder:
    """The decoder of `folder` with `mode` weights on `device`: from the cache when it holds them,
    else quantized now (and cached when `cache` is given). A pre-quantized folder has int4 weights
    whatever `mode` says (the caller says so: `engines.choose_quant`), repacked rather than quantized."""
    method = read_config(folder).quantization
    if method:
        mode, doing = "int4", f"repacking its {method.upper()} int4 weights"
        make = functools.partial(load_prequantized, folder, dtype, device)
    else:
        doing, make = f"quantizing to {mode}", functools.partial(quantize_checkpoint, folder, mode, dtype, device)
    if cache is None:
        return make().eval()

    def build(tmp: Path, reason: str) -> None:
        say(f"{Path(folder).name}: {doing} ({reason})")
        save_quantized(make(), tmp / FILE)

    model, cached = cache.get(quant_key(folder, mode, dtype, cache, method), build,
                              lambda tmp: load_quantized(folder, tmp / FILE, mode, dtype, device))
    say(f"{Path(folder).name}: {mode} weights " + (f"made and cached in {cached.seconds:.1f} s" if cached.built
                                                  else f"loaded from the cache in {cached.seconds:.2f} s"))
    return model
