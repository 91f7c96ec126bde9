"""SmolVLM's vision side from a transformers Idefics3 folder (SmolVLM-256M/500M/2B-Instruct as shipped).

Shapes come from `config.json` (`vision_config`, `scale_factor`, `text_config.hidden_size`; missing
keys take Idefics3's defaults, as transformers does). Only the `model.vision_model.*` and
`model.connector.*` tensors are read; the decoder's are `text.py`'s. Safetensors (single or sharded)
or `.bin` files, the latter with `weights_only=True`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from pipeline.errors import UserError
from pipeline.smolvlm.vision import SmolVLMVision, VisionConfig
from pipeline.weights_io import check_tensors, read_json, read_weight_file, weight_files

# Idefics3VisionConfig's defaults: a config.json key left out means these.
VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                       image_size=224, patch_size=32, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                       num_channels=3)
GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}

# transformers' Idefics3 name → ours (`vision.py`); q/k/v are fused separately (`QKV`).
RENAMES = [
    (r"^model\.vision_model\.embeddings\.patch_embedding\.", "encoder.embeddings.patch_embed."),
    (r"^model\.vision_model\.embeddings\.position_embedding\.", "encoder.embeddings.pos_embed."),
    (r"^model\.vision_model\.encoder\.layers\.(\d+)\.layer_norm([12])\.", r"encoder.blocks.\1.norm\2."),
    (r"^model\.vision_model\.encoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"encoder.blocks.\1.attn.proj."),
    (r"^model\.vision_model\.encoder\.layers\.(\d+)\.mlp\.(fc[12])\.", r"encoder.blocks.\1.mlp.\2."),
    (r"^model\.vision_model\.post_layernorm\.", "encoder.norm."),
    (r"^model\.connector\.modality_projection\.proj\.", "connector.proj."),
]
QKV = re.compile(r"^model\.vision_model\.encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")
WANTED = re.compile(r"^model\.(vision_model|connector)\.")


def config_from_hf(cfg: dict) -> VisionConfig:
    """The vision side's shapes from an Idefics3 `config.json`."""
    if cfg.get("model_type") not in ("idefics3", "smolvlm"):
        raise UserError(f"config.json's model_type is {cfg.get('model_type')!r}, not idefics3: not a SmolVLM folder")
    vision = VISION_DEFAULTS | (cfg.get("vision_config") or {})
    if vision["hidden_act"] not in GELU:
        raise UserError(f"vision_config.hidden_act {vision['hidden_act']!r} is not supported "
                        f"(supported: {', '.join(GELU)})")
    if vision["num_channels"] != 3:
        raise UserError(f"vision_config.num_channels is {vision['num_channels']}; SmolVLM reads RGB (3)")
    text = cfg.get("text_config") or {}
    return VisionConfig(
        image_size=vision["image_size"], patch_size=vision["patch_size"], width=vision["hidden_size"],
        depth=vision["num_hidden_layers"], heads=vision["num_attention_heads"], mlp=vision["intermediate_size"],
        eps=vision["layer_norm_eps"], gelu=GELU[vision["hidden_act"]], scale_factor=cfg.get("scale_factor", 2),
        text_width=text.get("hidden_size", 4096))


def read_vision_tensors(folder: Path) -> dict[str, Tensor]:
    """Only the vision encoder's and connector's tensors of an Idefics3 folder, under their file names."""
    out: dict[str, Tensor] = {}
    for path in weight_files(Path(folder)):
        out.update(read_weight_file(path, "SmolVLM weights", keep=lambda k: WANTED.match(k) is not None))
    return out


def to_ours(hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' names → ours, q/k/v weights and biases concatenated into `attn.qkv`."""
    out, pieces = {}, {}
    for key, tensor in hf.items():
        if m := QKV.match(key):
            pieces[(m[1], m[3], m[2])] = tensor
            continue
        for pattern, replacement in RENAMES:
            if re.search(pattern, key):
                out[re.sub(pattern, replacement, key)] = tensor
                break
    for layer, kind in sorted({(layer, kind) for layer, kind, _ in pieces}):
        try:
            parts = [pieces[(layer, kind, name)] for name in "qkv"]
        except KeyError as e:
            raise UserError(f"SmolVLM weights lack layer {layer}'s {e.args[0][2]}_proj.{kind}") from None
        out[f"encoder.blocks.{layer}.attn.qkv.{kind}"] = torch.cat(parts)
    return out


def build_vision(config: VisionConfig, state: dict[str, Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> SmolVLMVision:
    """`state` (our names) in a `SmolVLMVision` of `config`; a missing or misshapen tensor is a `UserError`."""
    with torch.device("meta"):
        model = SmolVLMVision(config)
    expected = model.state_dict()
    check_tensors(expected, state, "SmolVLM", extra_ok=True)
    model.load_state_dict({k: state[k] for k in expected}, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def load_vision(folder: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> SmolVLMVision:
    """The vision encoder and connector of a transformers Idefics3/SmolVLM folder."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UserError(f"no config.json in {folder}: point at a SmolVLM model folder")
    config = config_from_hf(read_json(folder / "config.json"))
    return build_vision(config, to_ours(read_vision_tensors(folder)), device, dtype)
