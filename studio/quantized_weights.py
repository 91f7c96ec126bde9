"""Quantized decoders, made once per checkpoint and kept in the engine cache.

Quantizing a 7B model means reading its 15 GB and rounding 7 billion weights; the result (at
Qwen2.5-7B 8.2 GB for int8, 5.1 GB for int4: the embedding stays float, the LM head is int8) is
written to the engine cache under a key holding the source weights' SHA-256, the mode, the group
size and this format's version, exactly as an engine is: the second launch reads it directly, a changed checkpoint is quantized again, and a
damaged or half-written file is never loaded (`engine_builder.cache`). Like an engine, the weights
made here are used only once they pass a check: before quantizing, each float layer's output on a
fixed probe input is stored beside them, and every quantized layer must reproduce it within its
rounding noise (`check_quantized`; the verdict is kept with the files). A pre-quantized (AWQ/GPTQ)
folder is repacked instead of quantized (`prequantized.py`), always into int4, and cached the same
way; it has no float weights to probe against (its repacking is tested against the formats' own
dequantization).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from engine_builder.cache import EngineCache, EngineKey, Verdict
from engine_builder.fingerprint import fingerprint
from pipeline.llm.model.loading import build_decoder, load_decoder, load_prequantized
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.weights.quant import int4_grid, int4_group, quantize_decoder, quantized_layers
from pipeline.weights_io import read_weight_file

FORMAT = "3"  # bump when the stored layout of quantized weights changes (2: the LM head in int8; 3: probes)
FILE = "decoder.safetensors"
PROBE = "probe.safetensors"  # the float layers' outputs on fixed inputs, made before quantizing
PROBE_ROWS = 4
TOLERANCE = {"int8": 0.02, "int4": 0.25}  # relative error of a layer's output: rounding noise, not a wrong layout


def quant_key(folder: Path, mode: str, dtype: torch.dtype, cache: EngineCache, method: str = "") -> EngineKey:
    """What a cached quantized decoder depends on: the weights, mode, group size, dtype and format
    (not the device: the stored tensors are the same for every GPU); `method` ("awq", "gptq"): the
    repacked weights of a pre-quantized checkpoint (`llm-int4-awq`)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return EngineKey(component=f"llm-{mode}" + (f"-{method}" if method else ""), source=str(Path(folder).resolve()),
                     weights=fingerprint([folder], cache.root), precision=f"{mode}/{dtype_name}",
                     profile=_int4_profile(read_config(folder)) if mode == "int4" else {}, builder="studio-quant",
                     builder_version=FORMAT, device="any")


def _int4_profile(config) -> dict:
    """The int4 group size, and how groups are found where it is not from their min and max (`int4_grid`)."""
    grid = int4_grid(config)
    return {"group": int4_group(config)} | ({"grid": grid} if grid != "minmax" else {})


def probe_input(in_features: int) -> torch.Tensor:
    return torch.randn(PROBE_ROWS, in_features, generator=torch.Generator().manual_seed(in_features))


def layer_names(model: Decoder, mode: str) -> list[tuple[str, str]]:
    """(qualified name, mode) of each layer `--quant mode` replaces."""
    names = {id(m): n for n, m in model.named_modules()}
    return [(f"{names[id(parent)]}.{attr}".lstrip("."), layer_mode)
            for parent, attr, layer_mode in quantized_layers(model, mode)]


def probe_outputs(model: Decoder, mode: str) -> dict[str, torch.Tensor]:
    """Each float layer's output on its probe input (float32): what its quantized weights must reproduce."""
    with torch.inference_mode():
        return {name: probe_input(layer.in_features) @ layer.weight.float().T
                for name, _ in layer_names(model, mode) for layer in [model.get_submodule(name)]}


def check_quantized(model: Decoder, mode: str, probes: dict[str, torch.Tensor]) -> Verdict:
    """The quantized layers' dequantized weights against the float layers' outputs on the probe inputs,
    layer by layer (whole-model logits of a random-weight model amplify rounding noise past any bound;
    a wrong layout shows as an error near 1 in every layer)."""
    worst: dict[str, tuple[float, str]] = {}
    passed = True
    with torch.inference_mode():
        for name, layer_mode in layer_names(model, mode):
            layer = model.get_submodule(name)
            weight = layer.weight_float().float()  # where the layer lives: only the small product moves
            got = (probe_input(layer.in_features).to(weight.device) @ weight.T).cpu()
            expected = probes[name]
            err = float((got - expected).norm() / expected.norm().clamp(min=1e-12))
            passed &= err <= TOLERANCE[layer_mode]
            if err > worst.get(layer_mode, (-1.0, ""))[0]:
                worst[layer_mode] = (err, name)
    numbers = "; ".join(f"{m} layers: worst error {e:.3g} ({n}; ≤ {TOLERANCE[m]:g})" for m, (e, n) in worst.items())
    return Verdict(passed, f"{mode} weights against the float layers on probe inputs", numbers)


def quantize_checkpoint(folder: Path, mode: str, dtype: torch.dtype,
                        device: torch.device) -> tuple[Decoder, dict[str, torch.Tensor]]:
    """Read the float checkpoint on the CPU and quantize it layer by layer on `device` (a bar per layer);
    also the float layers' probe outputs, taken first."""
    model = load_decoder(folder, dtype=dtype, device="cpu")
    probes = probe_outputs(model, mode)
    bar = functools.partial(tqdm, desc=f"quantizing to {mode}", unit="layer", file=sys.stderr)
    return quantize_decoder(model, mode, device, bar).to(device), probes


def save_quantized(model: Decoder, path: Path) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]  # the same tensor as the embedding: safetensors stores it once
    save_file(state, str(path), metadata={"format": "pt"})


def load_quantized(folder: Path, path: Path, mode: str, dtype: torch.dtype, device: torch.device) -> Decoder:
    """A quantized decoder from a file `save_quantized` wrote."""
    return build_decoder(read_config(folder), read_weight_file(path, "quantized weights", device=device), dtype, device,
                         mode)


def quantized_decoder(folder: Path, mode: str, dtype: torch.dtype, device: torch.device,
                      cache: EngineCache | None, say: Callable[[str], None]) -> Decoder:
    """The decoder of `folder` with `mode` weights on `device`: from the cache when it holds them,
    else quantized now (and cached when `cache` is given). A pre-quantized folder has int4 weights
    whatever `mode` says (the caller says so: `engines.choose_quant`), repacked rather than quantized."""
    method = read_config(folder).quantization
    if method:
        mode, doing = "int4", f"repacking its {method.upper()} int4 weights"

        def make() -> tuple[Decoder, None]:
            return load_prequantized(folder, dtype, device), None  # no float weights to probe against
    else:
        doing, make = f"quantizing to {mode}", functools.partial(quantize_checkpoint, folder, mode, dtype, device)
    if cache is None:
        return make()[0].eval()
    key = quant_key(folder, mode, dtype, cache, method)

    def build(tmp: Path, reason: str) -> None:
        say(f"{Path(folder).name}: {doing} ({reason})")
        model, probes = make()
        save_quantized(model, tmp / FILE)
        if probes is not None:
            save_file(probes, str(tmp / PROBE))

    def verify(model: Decoder) -> Verdict:
        say(f"{Path(folder).name}: checking the {mode} weights against the float layers")
        return check_quantized(model, mode, read_weight_file(cache.folder(key) / PROBE, "probe outputs"))

    model, cached = cache.get(key, build, lambda tmp: load_quantized(folder, tmp / FILE, mode, dtype, device),
                              None if method else verify)
    say(f"{Path(folder).name}: {mode} weights " + (f"made and cached in {cached.seconds:.1f} s" if cached.built
                                                  else f"loaded from the cache in {cached.seconds:.2f} s")
        + (f", {cached.verdict.line()}" if cached.verdict else ""))
    return model
