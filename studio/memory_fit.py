"""Whether a model fits this machine before it loads: what its weights take in each mode and on each device
(`weight_bytes`), the room there is for it (`memory_room`: the GPU budget, or the memory free on the CPU), and on
the CPU a one-line refusal of a model that would not fit the free memory (`check_memory`)."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from pipeline.errors import UserError
from pipeline.llm.model.loading import empty_decoder
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.weights.gguf_file import split_parts
from pipeline.llm.weights.quant import int4_group, quantized_layers

GGUF = "gguf"  # the weight mode of a GGUF file's own blocks (`pipeline/llm/weights/gguf_native.py`)
CONTEXTS = (32768, 16384, 8192, 4096, 2048, 1024, 512)  # the --context values a refusal may advise
# A GGUF file's ONNX Runtime engine on the CPU, resident ÷ the file: 1.80 and 1.86 at Qwen2.5-7B- and 1.5B-shape
# Q4_K_M (its float32 block scales and offsets, Q6_K as 8 bits; bench/RESULTS.md, 2026-11-29)
ONNX_RESIDENT = 1.9
HEADROOM_BYTES = 256 << 20  # beside the weights and the cache: a step's activations and the app's own growth


def available_memory() -> int:
    """The bytes this machine can give a model now without swapping (psutil's "available")."""
    return psutil.virtual_memory().available


def check_memory(model_id: str, config, mode: str, dtype: torch.dtype, context: int, available: int) -> None:
    """Refuse, in one line and before anything loads, a model whose weights and one conversation's cache would
    not fit the memory this machine has free (a laptop would swap to a halt), saying what it needs, what is free
    and what would fit: a shorter `--context` where the weights do, else closing programs or a smaller file."""
    weights = weight_bytes(config, mode, dtype, on_cpu=True)
    cache = KVCache.row_bytes(config, context + 1, dtype)
    if weights + cache + HEADROOM_BYTES <= available:
        return
    shorter = [c for c in CONTEXTS if c < context
               and weights + KVCache.row_bytes(config, c + 1, dtype) + HEADROOM_BYTES <= available]
    advice = f"close programs or use --context {shorter[0]}" if shorter else \
        "close programs, or use a smaller model (a 4-bit GGUF file of it, or fewer parameters)"
    precision = "float32" if mode == "none" else f"{config.gguf_type} (on ONNX Runtime)" if mode == GGUF else mode
    raise UserError(f"{model_id} needs {(weights + cache) / 1e9:.1f} GB of memory here ({weights / 1e9:.1f} GB of "
                    f"{precision} weights and {cache / 1e9:.1f} GB for a {context}-token conversation); "
                    f"{available / 1e9:.1f} GB are free: {advice}")


def memory_room(budget: int | None, device: str) -> tuple[int, str] | None:
    """(bytes, what they are) a model must fit: the GPU's budget; on the CPU the memory free now; None: no limit."""
    if budget is not None:
        return budget, "budget"
    return (available_memory(), "free") if device == "cpu" else None


def weight_bytes(config, mode: str, dtype: torch.dtype, on_cpu: bool = False) -> int:
    """What a decoder's weights take in memory with `mode` weights (see `quantized_layers` for which); a GGUF
    file's blocks as stored: on a GPU the file's size and 4 bytes per 256 weights of decoded sub-scales, on the
    CPU its ONNX Runtime engine's measured resident size (`ONNX_RESIDENT`)."""
    if mode == GGUF:
        return int(gguf_file_bytes(config) * (ONNX_RESIDENT if on_cpu else 1.03))
    model = empty_decoder(config)
    total = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    if mode == "none":
        return total
    per_weight = {"int8": 1 + 4 / config.hidden_size, "int4": 0.5 + 2 * dtype.itemsize / int4_group(config)}
    for parent, name, layer_mode in quantized_layers(model, mode):
        total -= int(getattr(parent, name).weight.numel() * (dtype.itemsize - per_weight[layer_mode]))
    return total


def gguf_file_bytes(config) -> int:
    """A GGUF model's file size, every part of a split one."""
    return sum(part.stat().st_size for part in split_parts(Path(config.gguf_file)))
