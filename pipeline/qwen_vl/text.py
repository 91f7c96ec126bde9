"""Qwen2.5-VL's decoder (Qwen2 with M-RoPE) from its folder, in our `Decoder`.

The hub's folders keep the decoder's shapes at the top of `config.json` (beside `vision_config`);
transformers 5 writes them under `text_config`. Either way its tensors are the Qwen2 layout
(`model.layers.N…`, `lm_head.weight`), read by the same table-driven loader as a Qwen2 checkpoint;
`rope_scaling`'s `mrope_section` says how the rotary pairs split over a token's time, row and column.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.llm.model.loading import decoder_from
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.weights.config import DecoderConfig, config_from_hf
from pipeline.llm.weights.families import HF_LAYOUT
from pipeline.weights_io import read_json

NOT_TEXT = ("vision_config", "text_config", "architectures", "model_type")


def text_config(folder: Path) -> DecoderConfig:
    """The decoder's config from a Qwen2.5-VL `config.json` (flat as on the hub, or nested)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in {folder}: point at a Qwen2.5-VL model folder")
    cfg = read_json(path)
    if cfg.get("model_type") != "qwen2_5_vl":
        raise UserError(f"config.json's model_type is {cfg.get('model_type')!r}, not qwen2_5_vl: "
                        f"not a Qwen2.5-VL folder")
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k not in NOT_TEXT})
    text["model_type"] = "qwen2"
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    config = config_from_hf(text)
    if not config.mrope_section:
        raise UserError("config.json's rope_scaling has no mrope_section: Qwen2.5-VL's decoder needs it")
    return config


def load_text_decoder(folder: Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> Decoder:
    """Qwen2.5-VL's decoder as our `Decoder` (its vision tensors are read and left aside)."""
    return decoder_from(folder, text_config(folder), HF_LAYOUT, dtype, device)
