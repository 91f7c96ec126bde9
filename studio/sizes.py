"""A tool's size before its first load, for the memory budget (after a load the host measures it)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine_builder.fingerprint import weight_files
from pipeline.errors import UserError
from pipeline.llm.weights.checkpoint import read_config
from pipeline.weights_io import loaded_bytes
from studio.memory_fit import GGUF, weight_bytes


def weights_size(*paths: Path | None, dtype: torch.dtype | None = None) -> int:
    """Bytes of the weight files at `paths` (files, or folders of them); with `dtype`, their floats
    counted at that width (how the loaders hold them)."""
    existing = [p for p in paths if p is not None and Path(p).exists()]
    return sum(loaded_bytes(f, dtype) if dtype is not None else f.stat().st_size for f in weight_files(existing))


def llm_size(folder: Path | None, quant: str, dtype: torch.dtype) -> int:
    """An LLM's size: its weight files, or with `--quant int8|int4` the quantized weights' bytes (a 13.5 GB
    bf16 Vicuna takes 3.9 GB in int4, and the budget must see that); an AWQ/GPTQ folder's are int4
    whatever `quant` says, and a GGUF file's are what it loads as, not its size on disk."""
    if folder is None or not (Path(folder) / "config.json").exists():
        return weights_size(folder, dtype=dtype)
    try:
        config = read_config(Path(folder))
    except (UserError, OSError, ValueError):  # a config the loader will refuse with its own message
        return weights_size(folder, dtype=dtype)
    mode = "int4" if config.quantization else quant
    if mode in ("int8", "int4", GGUF) or config.gguf_type:
        return weight_bytes(config, mode if mode in ("int8", "int4", GGUF) else "none", dtype)
    return weights_size(folder, dtype=dtype)
