"""The one factory that picks each tool's engine from the backend choice.

Pipelines, UI and API only see the engine seams (`LLMEngine`, the SAM and MiniGPT-4 vision
engines); a backend adds implementations here and nowhere else.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.llm.checkpoint import load_decoder
from pipeline.llm.engine import TorchLLMEngine
from pipeline.llm.language_model import LanguageModel
from pipeline.llm.model import KVCache
from pipeline.llm.tokenizer import load_tokenizer
from pipeline.minigpt4.engine import TorchVisionEncoder, VisionEncoder
from pipeline.minigpt4.vision import MiniGPT4Vision
from pipeline.sam.engine import SamEngine, torch_sam_engine
from pipeline.sam.model import Sam

BACKENDS = ("torch",)
KV_SHARE_OF_FREE_MEMORY = 0.4  # of what the GPU has free once the weights are in


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise UserError(f"backend {backend!r} is not available in this build; available: {', '.join(BACKENDS)}")


def cache_rows(config, context: int, dtype: torch.dtype, device: torch.device, max_batch: int,
               kv_cache_bytes: int | None) -> tuple[int, int]:
    """(cache rows, batch) that fit the KV budget: twice the batch where memory allows, so idle
    sessions keep their turns; the batch shrinks (to a power of two) where it does not."""
    row = KVCache.row_bytes(config, context + 1, dtype)
    if kv_cache_bytes is None:
        kv_cache_bytes = (int(torch.cuda.mem_get_info(device)[0] * KV_SHARE_OF_FREE_MEMORY)
                          if device.type == "cuda" else 2 * max_batch * row)
    rows = min(2 * max_batch, kv_cache_bytes // row)
    if rows < 1:
        raise UserError(f"not enough memory for the KV cache of one {context}-token conversation "
                        f"({row / 2**30:.1f} GiB): lower --context")
    batch = 1 << (min(max_batch, rows).bit_length() - 1)
    return rows, batch


def load_language_model(model_dir: Path, model_id: str, backend: str = "torch", device: str = "cpu",
                        dtype: torch.dtype = torch.float32, max_context: int = 8192, max_batch: int = 8,
                        kv_cache_bytes: int | None = None) -> LanguageModel:
    """Tokenizer + engine for a checkpoint folder; `max_batch` conversations decode together."""
    _check_backend(backend)
    tokenizer = load_tokenizer(model_dir)
    model = load_decoder(model_dir, dtype=dtype, device=device)
    context = min(max_context, model.config.max_position_embeddings)
    rows, batch = cache_rows(model.config, context, dtype, model.embed.weight.device, max_batch, kv_cache_bytes)
    engine = TorchLLMEngine(model, context, tokenizer.vocab_size, max_batch=batch, rows=rows)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    description = (f"{model_id} ({model.config.family}, {params:.1f} M params) · {engine.description} · "
                   f"{device} · {str(dtype).removeprefix('torch.')}")
    return LanguageModel(tokenizer, engine, model_id, description)


def sam_engine(model: Sam, backend: str = "torch") -> SamEngine:
    """SAM's encode/decode engine: captured CUDA graphs on a GPU, eager on the CPU."""
    _check_backend(backend)
    return torch_sam_engine(model)


def vision_encoder(model: MiniGPT4Vision, backend: str = "torch") -> VisionEncoder:
    """MiniGPT-4's image → query-embeddings engine."""
    _check_backend(backend)
    return TorchVisionEncoder(model)
