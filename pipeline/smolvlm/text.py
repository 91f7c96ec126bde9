"""SmolVLM's decoder (SmolLM2, a LLaMA) from an Idefics3 folder, in our `Decoder`.

The folder keeps the decoder under `model.text_model.*` (with `lm_head.weight` at the top) and its
shapes in `config.json`'s `text_config`: the LLaMA layout with another prefix, read by the same
table-driven loader as any LLaMA checkpoint. Whether the LM head is tied to the embeddings is the
top-level `tie_word_embeddings` (transformers ties by that one, not by `text_config`'s).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.llm.model.loading import decoder_from
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.weights.config import DecoderConfig, config_from_hf
from pipeline.llm.weights.families import HF_LAYOUT
from pipeline.weights_io import read_json

IDEFICS3_TEXT_LAYOUT = dataclasses.replace(
    HF_LAYOUT, embed="model.text_model.embed_tokens.weight", norm="model.text_model.norm.weight",
    layer="model.text_model.layers.{}.")


def text_config(folder: Path) -> DecoderConfig:
    """The decoder's config from an Idefics3 `config.json` (Idefics3's text defaults: LLaMA, RMS eps 1e-5)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in {folder}: point at a SmolVLM model folder")
    cfg = read_json(path)
    text = {"model_type": "llama", "rms_norm_eps": 1e-5} | dict(cfg.get("text_config") or {})
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    return config_from_hf(text)


def load_text_decoder(folder: Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> Decoder:
    """SmolVLM's decoder as our `Decoder` (its vision tensors are read and left aside)."""
    return decoder_from(folder, text_config(folder), IDEFICS3_TEXT_LAYOUT, dtype, device)
