"""Loading MiniGPT-4's vision side from the files users have, and the tiny demo.

Sources, any of which combine with the MiniGPT-4 checkpoint (`prerained_minigpt4_7b.pth`, whose
`model` dict holds `llama_proj`):
- original: `eva_vit_g.pth` (EVA's own names) + `blip2_pretrained_flant5xxl.pth` (`model` dict with
  `Qformer.bert.*`, `query_tokens`, `ln_vision.*`; its text-side tensors are ignored);
- transformers: a BLIP-2 folder (`vision_model.*`, `qformer.*`, `query_tokens`; safetensors,
  sharded or not), of which only those tensors are read.
Sizes are read off the tensors; heads follow the originals' rules (ViT-g: width / 88, Q-Former: width / 64).
All `.pth` files load with `weights_only=True`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from filelock import FileLock
from torch import Tensor

from pipeline.errors import UserError
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.demo import demo_model_dir
from pipeline.minigpt4.vision import TINY, MiniGPT4Vision, VisionConfig
from pipeline.random_weights import spread_weights
from pipeline.weights_io import read_json, read_weight_file, write_weight_file

# transformers BLIP-2 name → original name (EVA ViT-g / BLIP-2 / MiniGPT-4)
HF_TO_ORIGINAL = [
    (r"^vision_model\.embeddings\.class_embedding$", "visual_encoder.cls_token"),
    (r"^vision_model\.embeddings\.position_embedding$", "visual_encoder.pos_embed"),
    (r"^vision_model\.embeddings\.patch_embedding\.", "visual_encoder.patch_embed.proj."),
    (r"^vision_model\.encoder\.layers\.(\d+)\.self_attn\.qkv\.weight$", r"visual_encoder.blocks.\1.attn.qkv.weight"),
    (r"^vision_model\.encoder\.layers\.(\d+)\.self_attn\.(q_bias|v_bias)$", r"visual_encoder.blocks.\1.attn.\2"),
    (r"^vision_model\.encoder\.layers\.(\d+)\.self_attn\.projection\.", r"visual_encoder.blocks.\1.attn.proj."),
    (r"^vision_model\.encoder\.layers\.(\d+)\.layer_norm([12])\.", r"visual_encoder.blocks.\1.norm\2."),
    (r"^vision_model\.encoder\.layers\.(\d+)\.mlp\.", r"visual_encoder.blocks.\1.mlp."),
    (r"^vision_model\.post_layernorm\.", "ln_vision."),
    (r"^qformer\.layernorm\.", "Qformer.bert.embeddings.LayerNorm."),
    (r"^qformer\.encoder\.layer\.(\d+)\.(attention|crossattention)\.attention\.",
     r"Qformer.bert.encoder.layer.\1.\2.self."),
    (r"^qformer\.encoder\.layer\.(\d+)\.", r"Qformer.bert.encoder.layer.\1."),
    (r"^query_tokens$", "query_tokens"),
]
QKV_BIAS = re.compile(r"^vision_model\.encoder\.layers\.(\d+)\.self_attn\.qkv\.bias$")


def hf_to_original(hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a transformers BLIP-2 state dict (vision + Q-Former parts) to the original names.

    transformers stores EVA's q/v biases as one qkv bias [q; k; v]; EVA has no k bias, and a k bias
    would not change attention (it adds the same q·b to every key's logit), so it is dropped.
    """
    out = {}
    for key, tensor in hf.items():
        if m := QKV_BIAS.match(key):
            q, _, v = tensor.chunk(3)
            out[f"visual_encoder.blocks.{m[1]}.attn.q_bias"] = q
            out[f"visual_encoder.blocks.{m[1]}.attn.v_bias"] = v
            continue
        for pattern, replacement in HF_TO_ORIGINAL:
            if re.search(pattern, key):
                out[re.sub(pattern, replacement, key)] = tensor
                break
    return out


def config_from_tensors(state: dict[str, Tensor], llm_width: int | None = None) -> VisionConfig:
    try:
        vit_width = state["visual_encoder.pos_embed"].shape[-1]
        patch = state["visual_encoder.patch_embed.proj.weight"].shape[-1]
        tokens = state["visual_encoder.pos_embed"].shape[1] - 1
        qformer_width = state["query_tokens"].shape[-1]
    except KeyError as e:
        raise UserError(f"vision weights are incomplete: missing {e}") from None

    def count(prefix: str) -> int:
        return 1 + max(int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix))

    cross = sorted(int(k.split(".")[4]) for k in state if ".crossattention.self.query.weight" in k)
    return VisionConfig(
        img_size=int(round(tokens ** 0.5)) * patch, patch_size=patch, vit_width=vit_width,
        vit_depth=count("visual_encoder.blocks."), vit_heads=max(1, vit_width // 88),
        vit_mlp=state["visual_encoder.blocks.0.mlp.fc1.weight"].shape[0], qformer_width=qformer_width,
        qformer_depth=count("Qformer.bert.encoder.layer."), qformer_heads=max(1, qformer_width // 64),
        qformer_mlp=state["Qformer.bert.encoder.layer.0.intermediate_query.dense.weight"].shape[0],
        cross_attention_freq=cross[1] - cross[0] if len(cross) > 1 else 2,
        num_query_tokens=state["query_tokens"].shape[1],
        llm_width=llm_width or state["llama_proj.weight"].shape[0])


def read_hf_blip2(folder: Path) -> dict[str, Tensor]:
    """Only the vision, Q-Former and query tensors of a transformers BLIP-2 folder (not its LLM)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(read_json(index).get("weight_map", {}).values())) if index.is_file() else \
        [p.name for p in folder.glob("*.safetensors")]
    if not files:
        raise UserError(f"no safetensors files in {folder}")
    wanted = re.compile(r"^(vision_model\.|qformer\.|query_tokens$)")
    out = {}
    for name in files:
        out.update(read_weight_file(folder / name, "BLIP-2 weights", keep=wanted.match))
    return out


def load_vision(minigpt4_ckpt: Path, *, eva: Path | None = None, blip2: Path | None = None,
                hf_blip2: Path | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> MiniGPT4Vision:
    """Build the vision side from original files (`eva` + `blip2`) or a transformers BLIP-2 folder."""
    if hf_blip2 is not None:
        state = hf_to_original(read_hf_blip2(hf_blip2))
    elif eva is not None and blip2 is not None:
        eva_state = read_weight_file(eva, "EVA ViT-g weights")
        state = {k if k.startswith("visual_encoder.") else f"visual_encoder.{k}": v for k, v in eva_state.items()}
        state.update(read_weight_file(blip2, "BLIP-2 weights", keep=lambda k: k.startswith(
            ("Qformer.bert.", "query_tokens", "ln_vision.", "visual_encoder."))))
    else:
        raise UserError("give the vision weights: eva_vit_g.pth + blip2_pretrained_flant5xxl.pth, "
                        "or a transformers BLIP-2 folder")
    state.update(read_weight_file(minigpt4_ckpt, "MiniGPT-4 checkpoint", keep=lambda k: k.startswith("llama_proj.")))
    config = config_from_tensors(state)
    with torch.device("meta"):
        model = MiniGPT4Vision(config)
    expected = model.state_dict().keys()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UserError(f"vision weights lack {len(missing)} tensors, e.g. {missing[0]}")
    model.load_state_dict({k: state[k] for k in expected}, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def build_demo(folder: Path, llm_width: int, config: VisionConfig = TINY) -> None:
    """Random vision weights (tiny by default; `config` gives other shapes, e.g. the real ones for a
    memory benchmark) written as the original three files, loaded like real ones."""
    state = spread_weights(lambda: MiniGPT4Vision(dataclasses.replace(config, llm_width=llm_width)),
                           seed=2024).state_dict()
    eva = {k.removeprefix("visual_encoder."): v for k, v in state.items() if k.startswith("visual_encoder.")}
    blip2 = {k: v for k, v in state.items() if k.startswith(("Qformer.", "query_tokens", "ln_vision."))}
    minigpt4 = {k: v for k, v in state.items() if k.startswith("llama_proj.")}
    for name, part in (("eva_vit_g.pth", eva), ("blip2_pretrained_flant5xxl.pth", {"model": blip2}),
                       (CHECKPOINT, {"model": minigpt4})):
        write_weight_file(folder / name, part)


def load_vision_folder(minigpt4_ckpt: Path, vision_dir: Path, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> MiniGPT4Vision:
    """The vision side from a folder holding either the original files or a transformers BLIP-2 checkpoint."""
    vision_dir = Path(vision_dir)
    if (vision_dir / "eva_vit_g.pth").is_file() and (vision_dir / "blip2_pretrained_flant5xxl.pth").is_file():
        return load_vision(minigpt4_ckpt, eva=vision_dir / "eva_vit_g.pth",
                           blip2=vision_dir / "blip2_pretrained_flant5xxl.pth", device=device, dtype=dtype)
    if any(vision_dir.glob("*.safetensors")):
        return load_vision(minigpt4_ckpt, hf_blip2=vision_dir, device=device, dtype=dtype)
    raise UserError(f"{vision_dir} holds neither eva_vit_g.pth + blip2_pretrained_flant5xxl.pth nor a "
                    f"transformers BLIP-2 checkpoint (*.safetensors)")


CHECKPOINT = "prerained_minigpt4_7b.pth"  # the MiniGPT-4 release's name for the file holding llama_proj
DEMO_LLM = "demo/llama-tiny"


def demo_parts(cache_dir: Path) -> tuple[Path, Path, Path]:
    """The demo MiniGPT-4 as (checkpoint, vision folder, LLM folder), built into the cache once."""
    llm_dir = demo_model_dir(DEMO_LLM, cache_dir)
    vision_dir = demo_vision_dir(cache_dir, llm_width=read_config(llm_dir).hidden_size)
    return vision_dir / CHECKPOINT, vision_dir, llm_dir


def demo_vision_folder(cache_dir: Path) -> Path:
    """Where the demo's vision files live (built or not)."""
    return Path(cache_dir) / "demo" / "minigpt4-tiny"


def demo_vision_dir(cache_dir: Path, llm_width: int) -> Path:
    """The demo's three vision files, built once into the cache (atomically, one builder at a time)."""
    folder = demo_vision_folder(cache_dir)
    done = folder / CHECKPOINT
    if not done.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder) + ".lock"):
            if not done.is_file():
                build_demo(folder, llm_width)  # writes CHECKPOINT last
    return folder


def projection_width(minigpt4_ckpt: Path) -> int:
    """The width of the embeddings MiniGPT-4's `llama_proj` makes: the LLM it feeds must take that width."""
    state = read_weight_file(minigpt4_ckpt, "MiniGPT-4 checkpoint", keep=lambda k: k == "llama_proj.weight")
    if "llama_proj.weight" not in state:
        raise UserError(f"{minigpt4_ckpt} holds no llama_proj.weight: it is not a MiniGPT-4 checkpoint")
    return int(state["llama_proj.weight"].shape[0])
