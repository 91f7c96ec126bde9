"""A decoder LLM read as an embedder (Qwen3-Embedding; gte-Qwen2 and other last-token embedders of the families the
chat engine runs): the chat engine's own `Decoder`, each text's embedding the last token's normalized state. The
texts of a batch are one step of prompts, all in one cache row, read one after another within each layer: no
padding, and a cache of one text's length whatever the batch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor

from pipeline.llm.model.loading import build_decoder
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.weights.checkpoint import layout_of, read_config, read_tensors, to_internal

DECODERS = ("qwen2", "qwen3", "llama")  # model types read this way (the chat engine's transformers families)


class DecoderEncoder:
    """`last_states(texts' token ids)` → [B, hidden], the last token's final state of each."""

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype):
        config = read_config(folder)
        layout = layout_of(config)
        tensors = read_tensors(folder, dtype)
        if layout.embed not in tensors:  # saved as the bare model (sentence-transformers does): no "model." prefix
            tensors = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in tensors.items()}
        tensors.pop("lm_head.weight", None)
        self.config = dataclasses.replace(config, tie_word_embeddings=True)  # the head is never used: no copy of it
        self.model = build_decoder(self.config, to_internal(self.config, tensors, layout), dtype, device)
        self.device, self.dtype = device, dtype
        self.hidden_size, self.max_positions = config.hidden_size, config.max_position_embeddings

    def last_states(self, batch: list[list[int]]) -> Tensor:
        longest = max(map(len, batch))
        cache = KVCache(self.config, 1, longest, self.dtype, self.device)
        rope = RotaryTables(self.config, longest, self.device)
        tokens = torch.tensor([i for ids in batch for i in ids], device=self.device)[None]
        ends = torch.tensor([len(ids) for ids in batch], device=self.device).cumsum(0) - 1
        parts = tuple(Prefill(row=0, start=0, size=len(ids)) for ids in batch)
        return self.model(cache, rope, parts, tokens, outputs=ends, hidden=True)[0]
