"""Qwen2.5-VL's vision tower from a transformers folder (Qwen/Qwen2.5-VL-3B/7B/72B-Instruct as shipped).

Shapes come from `config.json`'s `vision_config` (missing keys take Qwen2_5_VLVisionConfig's defaults,
as transformers does). Only the vision tensors are read; the decoder's belong to the text side. Two
key layouts name them: the hub's and transformers 5's `save_pretrained` (`visual.…`), and the
in-memory one of `Qwen2_5_VLForConditionalGeneration.state_dict()` (`model.visual.…`), which other
tools write. Safetensors (single or sharded) or `.bin` files, the latter with `weights_only=True`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from pipeline.errors import UserError
from pipeline.qwen_vl.vision import ACTIVATIONS, QwenVLVision, VisionConfig
from pipeline.weights_io import check_tensors, read_json, read_weight_file, weight_files

# Qwen2_5_VLVisionConfig's defaults: a vision_config key left out means these.
VISION_DEFAULTS = dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                       in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31])
ALIASES = {"num_hidden_layers": "depth", "num_attention_heads": "num_heads"}  # transformers' attribute_map
ROPE_THETA = 10000.0

VISION = re.compile(r"^(?:model\.)?visual\.")
# The checkpoint's name (after the `visual.` prefix) → ours (`vision.py`).
RENAMES = [
    (r"^patch_embed\.proj\.weight$", "patch_embed.weight"),
    (r"^blocks\.(\d+)\.", r"blocks.\1."),
    (r"^merger\.ln_q\.", "merger.norm."),
    (r"^merger\.mlp\.0\.", "merger.fc1."),
    (r"^merger\.mlp\.2\.", "merger.fc2."),
]


def config_from_hf(cfg: dict) -> VisionConfig:
    """The vision tower's shapes from a Qwen2.5-VL `config.json`."""
    if cfg.get("model_type") != "qwen2_5_vl":
        raise UserError(f"config.json's model_type is {cfg.get('model_type')!r}, not qwen2_5_vl: "
                        f"not a Qwen2.5-VL folder")
    given = cfg.get("vision_config") or {}
    v = VISION_DEFAULTS | {ALIASES.get(k, k): value for k, value in given.items()}
    if v["hidden_act"] not in ACTIVATIONS:
        raise UserError(f"vision_config.hidden_act {v['hidden_act']!r} is not supported "
                        f"(supported: {', '.join(ACTIVATIONS)})")
    if v["in_channels"] != 3:
        raise UserError(f"vision_config.in_channels is {v['in_channels']}; Qwen2.5-VL reads RGB (3)")
    if v["hidden_size"] % v["num_heads"] or v["hidden_size"] // v["num_heads"] % 4:
        raise UserError(f"vision_config.hidden_size {v['hidden_size']} does not split into {v['num_heads']} heads "
                        f"of a multiple of 4 (the 2-D rotary needs it)")
    config = VisionConfig(
        depth=v["depth"], hidden_size=v["hidden_size"], num_heads=v["num_heads"],
        intermediate_size=v["intermediate_size"], out_hidden_size=v["out_hidden_size"], patch_size=v["patch_size"],
        spatial_merge_size=v["spatial_merge_size"], temporal_patch_size=v["temporal_patch_size"],
        window_size=v["window_size"], fullatt_block_indexes=tuple(v["fullatt_block_indexes"]),
        hidden_act=v["hidden_act"], in_channels=v["in_channels"],
        rope_theta=(v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", ROPE_THETA)))
    if config.window_cells < 1:
        raise UserError(f"vision_config.window_size {config.window_size} is smaller than one merged cell "
                        f"({config.patch_size * config.spatial_merge_size} pixels)")
    return config


def read_vision_tensors(folder: Path) -> dict[str, Tensor]:
    """Only the vision tower's tensors of a Qwen2.5-VL folder, under their file names."""
    out: dict[str, Tensor] = {}
    for path in weight_files(Path(folder)):
        out.update(read_weight_file(path, "Qwen2.5-VL weights", keep=lambda k: VISION.match(k) is not None))
    return out


def to_ours(checkpoint: dict[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint's names (either layout) → ours; a name no rule knows is a `UserError`."""
    out, unknown = {}, []
    for key, tensor in checkpoint.items():
        name = VISION.sub("", key)
        rule = next((r for r in RENAMES if re.search(r[0], name)), None)
        if rule is None:
            unknown.append(key)
        else:
            out[re.sub(rule[0], rule[1], name)] = tensor
    if unknown:
        raise UserError(f"Qwen2.5-VL weights hold {len(unknown)} vision tensors this loader does not know, "
                        f"e.g. {sorted(unknown)[0]}: not a Qwen2.5-VL checkpoint?")
    return out


def build_vision(config: VisionConfig, state: dict[str, Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> QwenVLVision:
    """`state` (our names) in a `QwenVLVision` of `config`; a missing, extra or misshapen tensor is a `UserError`."""
    with torch.device("meta"):
        model = QwenVLVision(config)
    check_tensors(model.state_dict(), state, "Qwen2.5-VL", f" (config.json says {config.depth} blocks)")
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def load_vision(folder: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> QwenVLVision:
    """The vision tower of a transformers Qwen2.5-VL folder."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UserError(f"no config.json in {folder}: point at a Qwen2.5-VL model folder")
    config = config_from_hf(read_json(folder / "config.json"))
    return build_vision(config, to_ours(read_vision_tensors(folder)), device, dtype)
