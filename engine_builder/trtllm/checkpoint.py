"""Our decoders as TensorRT-LLM checkpoints: the `config.json` + `rank0.safetensors` folder that
TensorRT-LLM's builder reads (docs/source/architecture/checkpoint.md, the same from 0.21 to 1.2).

Written from our own loaders, so every format we read (Qwen v1's own, transformers') becomes one.
Qwen v1 is written in the Qwen2 format (`qwen_type` "qwen2": the same network without logn scaling
and dynamic NTK, exact within its trained `seq_length`, which therefore caps the engine's context).

Weight-only quantization:
- int8 is `W8A16` (per channel): TensorRT-LLM's `from_checkpoint` quantizes the float weights itself.
- int4 is grouped (`W4A16_AWQ`, group 128, or 64 for layers narrower than 128): TensorRT-LLM makes
  grouped int4 from float weights only through a calibration run (ModelOpt), and its per-channel
  `W4A16` loses quality. So we write the quantized weights ourselves, round-to-nearest per group
  with symmetric scales (the AWQ format with its pre-quantization scale at 1): each linear's
  `weight` packs two output rows per byte as ModelOpt's exporter does (int8 [out/2, in], the even
  row in the low nibble), `weights_scaling_factor` is [out, in/group] and `prequant_scaling_factor`
  [in]; `from_checkpoint` turns them into its kernels' layout.
The embedding and the LM head stay in the model dtype.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pipeline.errors import UserError
from pipeline.llm.weights.checkpoint import from_internal, layout_of, read_config, read_tensors, to_internal
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.weights.families import TRTLLM_LAYOUT

# Our family → (TensorRT-LLM architecture, qwen_type)
ARCHITECTURES = {"qwen": ("Qwen2ForCausalLM", "qwen2"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "llama": ("LlamaForCausalLM", None)}
QUANT_ALGOS = {"none": None, "int8": "W8A16", "int4": "W4A16_AWQ"}
QUANTIZED = ("attention.qkv.weight", "attention.dense.weight", "mlp.fc.weight", "mlp.gate.weight", "mlp.proj.weight")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def engine_context(config: DecoderConfig, max_context: int) -> int:
    """Positions an engine serves: Qwen v1 stops at its trained length (no dynamic NTK in Qwen2)."""
    limit = config.seq_length if config.family == "qwen" and config.seq_length else config.max_position_embeddings
    return min(max_context, limit)


def trtllm_config(config: DecoderConfig, dtype: str, quant: str, context: int) -> dict[str, Any]:
    """TensorRT-LLM's `config.json` for our decoder config."""
    if config.family not in ARCHITECTURES:
        raise UserError(f"TensorRT-LLM engines are built for Qwen v1, Qwen2/2.5 and LLaMA/Vicuna, "
                        f"not {config.family}")
    if quant not in QUANT_ALGOS:
        raise UserError(f"unknown weight quantization {quant!r}: use {', '.join(QUANT_ALGOS)}")
    if config.rope_scaling:
        raise UserError("TensorRT-LLM checkpoints are not written with rope_scaling yet; the torch engine runs "
                        "this model")
    architecture, qwen_type = ARCHITECTURES[config.family]
    out: dict[str, Any] = {
        "architecture": architecture,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_size": config.head_dim,
        "hidden_act": "silu",
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": context,
        "rotary_base": config.rope_theta,
        "rotary_scaling": None,
        "norm_epsilon": config.rms_norm_eps,
        "attn_bias": config.qkv_bias,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": QUANT_ALGOS[quant], "kv_cache_quant_algo": None,
                         "group_size": int4_group(config) if quant == "int4" else 128, "has_zero_point": False,
                         "pre_quant_scale": quant == "int4", "exclude_modules": ["lm_head"] if quant == "int4" else None},
    }
    if qwen_type:
        out.update(qwen_type=qwen_type, use_logn_attn=False, seq_length=context)
    return out


def int4_group(config: DecoderConfig) -> int:
    """The int4 group size: 128, or 64 where a linear's input is narrower (TensorRT-LLM takes both)."""
    widths = (config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size)
    for group in (128, 64):
        if all(w % group == 0 for w in widths):
            return group
    raise UserError(f"int4 weights need layer widths divisible by 64; this model has {widths}: use --quant int8")


def pack_int4_grouped(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 [out/2, in], scales [out, in/group]) of `weight` [out, in]: symmetric round-to-nearest
    per group of `group` inputs into [-8, 7], two output rows per byte, the even one in the low nibble."""
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group, group)
    scale = (w.abs().amax(-1, keepdim=True) / 7).clamp(min=1e-8)
    q = (w / scale).round().clamp(-8, 7).to(torch.int8).reshape(out_features, in_features)
    pairs = q.reshape(out_features // 2, 2, in_features)
    packed = (pairs[:, 0] & 0x0F) | (pairs[:, 1] << 4)
    return packed.to(torch.int8), scale.squeeze(-1)


def trtllm_weights(config: DecoderConfig, internal: dict[str, torch.Tensor], dtype: str,
                   quant: str = "none") -> dict[str, torch.Tensor]:
    """Our decoder's tensors under TensorRT-LLM's names, in `dtype`; the LM head is always written (a
    tied one as a copy of the embedding), as TensorRT-LLM's own converters do; int4 linears packed."""
    raw = from_internal(config, internal, TRTLLM_LAYOUT)
    raw["lm_head.weight"] = internal["lm_head.weight"]
    out = {k: v.detach().to(DTYPES[dtype]).contiguous().clone() for k, v in raw.items()}
    if quant == "int4":
        group = int4_group(config)
        for name in [n for n in out if n.endswith(QUANTIZED)]:
            packed, scale = pack_int4_grouped(raw[name], group)
            base = name.removesuffix("weight")
            out[name] = packed
            out[base + "weights_scaling_factor"] = scale.to(DTYPES[dtype])
            out[base + "prequant_scaling_factor"] = torch.ones(raw[name].shape[1], dtype=DTYPES[dtype])
    return out


def write_trtllm_checkpoint(model_dir: Path, out: Path, dtype: str, quant: str, max_context: int) -> dict[str, Any]:
    """Read a checkpoint folder with our loaders and write it as a TensorRT-LLM checkpoint into `out`
    (an existing, empty folder); returns the config written."""
    config = read_config(model_dir)
    internal = to_internal(config, read_tensors(model_dir, DTYPES[dtype]), layout_of(config))
    cfg = trtllm_config(config, dtype, quant, engine_context(config, max_context))
    save_file(trtllm_weights(config, internal, dtype, quant), str(Path(out) / "rank0.safetensors"))
    (Path(out) / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg
