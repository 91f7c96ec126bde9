"""One config for every decoder we run, derived from the checkpoint's own `config.json`.

The families differ only in a few switches (qkv bias, qk-norm, GQA, Qwen v1's logn scaling and
dynamic NTK), so one dataclass describes them all and the model code reads only this. Which family
has which switches is `families.FAMILIES`' business; this module reads and writes config.json.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pipeline.errors import UserError
from pipeline.llm.weights.families import FAMILIES, QWEN_V1, family_of
from pipeline.llm.weights.quant_config import scheme_of


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    o_bias: bool = False  # a bias on the attention output (LLaMA's and Qwen3's `attention_bias` set both)
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # Qwen v1 long-context tricks: both switch on past `seq_length` (the trained context).
    logn_attn: bool = False
    dynamic_ntk: bool = False
    seq_length: int = 0
    # RoPE scaling as (key, value) pairs, `rope_type` first ("linear", "llama3", "yarn"); () = none.
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    # M-RoPE (Qwen2.5-VL's decoder): how many rotary pairs turn by a token's time, row and column position.
    mrope_section: tuple[int, ...] = ()
    # "awq" or "gptq": the checkpoint holds pre-quantized int4 weights (`prequantized.py`); "": float ones.
    quantization: str = ""
    # A GGUF file's quantization as users name it ("Q4_K_M", "Q8_0", "F16"); "": not a GGUF file.
    gguf_type: str = ""
    # the types of its blocks' weight matrices ("Q4_K", "Q5_0", "Q6_K"): what `--quant auto` chooses by
    gguf_tensor_types: tuple[str, ...] = ()
    # the GGUF file (its first part, if split): what its blocks take when they run as stored
    gguf_file: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def trained_context(self) -> int:
        """The context it was trained on (Qwen v1 runs past it with dynamic NTK)."""
        return self.seq_length or self.max_position_embeddings

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _require(cfg: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise UserError(f"config.json lacks {', '.join(missing)}: is this a complete checkpoint folder?")


# The RoPE scalings we implement (`model.inverse_frequencies`), with their required and optional keys.
ROPE_SCALINGS = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}


def _rope(cfg: dict) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """RoPE base and scaling from hub configs (`rope_theta` + `rope_scaling`) or transformers 5's
    `rope_parameters`; a scaling we do not implement is refused by name, never run unscaled."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type")) or "default"
    kind = "default" if kind == "mrope" else kind  # the hub's Qwen2.5-VL name for plain RoPE in sections
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"rope partial_rotary_factor {rope['partial_rotary_factor']} is not supported")
    if kind == "default":
        return theta, ()
    if kind not in ROPE_SCALINGS:
        raise UserError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)}); "
                        f"this checkpoint would give wrong answers without it")
    required, optional = ROPE_SCALINGS[kind]
    if kind == "yarn":
        rope.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    missing = [k for k in required if rope.get(k) is None]
    if missing:
        raise UserError(f"rope_scaling {kind!r} lacks {', '.join(missing)} in config.json")
    return theta, (("rope_type", kind),) + tuple((k, rope[k]) for k in required + optional if rope.get(k) is not None)


def _mrope_section(cfg: dict) -> tuple[int, ...]:
    """M-RoPE's sections (Qwen2.5-VL), checked to cover the rotary pairs: a wrong split would run."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    section = tuple(int(n) for n in rope.get("mrope_section") or ())
    pairs = (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) // 2
    if section and (len(section) != 3 or sum(section) != pairs):
        raise UserError(f"rope mrope_section {list(section)} must be three counts adding up to {pairs}, "
                        f"the rotary pairs of a head")
    return section


# Config fields that change the math, with the value we implement; anything else is refused by name.
MATH_FIELDS = {"hidden_act": "silu", "partial_rotary_factor": 1.0, "mlp_bias": False, "use_sliding_window": False}


def _quantization(cfg: dict) -> str:
    """`DecoderConfig.quantization` for `quantization_config`; one we cannot run is refused by name."""
    if cfg.get("quantization_config") is None:
        return ""
    return scheme_of(cfg["quantization_config"]).method


def _refuse_unsupported(cfg: dict) -> None:
    for field, supported in MATH_FIELDS.items():
        if field in cfg and cfg[field] not in (supported, None):
            raise UserError(f"config.json sets {field}: {json.dumps(cfg[field])[:80]}, which this app does not "
                            f"implement (it supports {json.dumps(supported)}); it would give wrong answers")
    layers = cfg.get("layer_types") or []
    if any(kind != "full_attention" for kind in layers):
        raise UserError(f"config.json's layer_types include {sorted(set(layers) - {'full_attention'})}: only "
                        f"full attention is implemented")


def config_from_hf(cfg: dict) -> DecoderConfig:
    """Map a transformers-style `config.json` (Qwen2/2.5, Qwen3, LLaMA/Vicuna) or a Qwen v1 one."""
    family = family_of(cfg.get("model_type"))
    _require(cfg, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if not family.is_transformers:
        return _config_from_qwen_v1(cfg)
    _refuse_unsupported(cfg)
    heads = cfg["num_attention_heads"]
    theta, scaling = _rope(cfg)
    attention_bias = bool(cfg.get("attention_bias", False))
    return DecoderConfig(
        family=family.model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        mrope_section=_mrope_section(cfg),
        qkv_bias=family.qkv_bias if family.qkv_bias is not None else attention_bias,
        o_bias=family.qkv_bias is None and attention_bias,
        qk_norm=family.qk_norm,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        quantization=_quantization(cfg),
        gguf_type=str((cfg.get("gguf") or {}).get("quant_type", "")),
        gguf_tensor_types=tuple((cfg.get("gguf") or {}).get("tensor_types", ())),
        gguf_file=str((cfg.get("gguf") or {}).get("file", "")),
    )


def _config_from_qwen_v1(cfg: dict) -> DecoderConfig:
    """Qwen-7B-Chat's config: `intermediate_size` counts w1 and w2 together, so it halves."""
    if cfg.get("rotary_pct", 1.0) != 1.0:
        raise UserError("Qwen v1 checkpoints with rotary_pct != 1 are not supported")
    heads = cfg["num_attention_heads"]
    seq_length = cfg.get("seq_length", 2048)
    return DecoderConfig(
        family=QWEN_V1.model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"] // 2,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=cfg.get("kv_channels") or cfg["hidden_size"] // heads,
        # Dynamic NTK is what lets Qwen v1 run past its trained length; 32768 is its logn table size.
        max_position_embeddings=32768 if cfg.get("use_dynamic_ntk", False) else seq_length,
        rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-6),
        rope_theta=float(cfg.get("rotary_emb_base", 10000.0)),
        qkv_bias=QWEN_V1.qkv_bias,
        qk_norm=QWEN_V1.qk_norm,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        logn_attn=bool(cfg.get("use_logn_attn", False)),
        dynamic_ntk=bool(cfg.get("use_dynamic_ntk", False)),
        seq_length=seq_length,
        quantization=_quantization(cfg),  # Qwen-7B-Chat-Int4 is a GPTQ checkpoint
    )


def hf_config_dict(config: DecoderConfig) -> dict[str, Any]:
    """The transformers `config.json` for our config (Qwen v1 is written as Qwen2, its closest kin)."""
    family = FAMILIES[family_of(config.family).transformers_type]
    out: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.trained_context,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
    }
    if family.qkv_bias is None:
        if config.qkv_bias != config.o_bias:
            raise UserError(f"{family.name} configs have one attention_bias for q/k/v and the output together")
        out["attention_bias"] = config.qkv_bias
    elif config.o_bias:
        raise UserError(f"{family.name} has no bias on the attention output")
    if config.rope_scaling:
        out["rope_scaling"] = dict(config.rope_scaling)
    return out


def qwen_v1_config_dict(config: DecoderConfig) -> dict[str, Any]:
    """Qwen v1's own `config.json` layout, as Qwen-7B-Chat ships it."""
    if (config.num_kv_heads != config.num_heads or config.qkv_bias != QWEN_V1.qkv_bias
            or config.qk_norm != QWEN_V1.qk_norm or config.o_bias or config.rope_scaling):
        raise UserError("only MHA decoders with qkv bias and no qk-norm can be written in Qwen v1 format")
    return {
        "architectures": [QWEN_V1.architecture],
        "model_type": QWEN_V1.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size * 2,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "kv_channels": config.head_dim,
        "layer_norm_epsilon": config.rms_norm_eps,
        "rotary_emb_base": config.rope_theta,
        "rotary_pct": 1.0,
        "seq_length": config.trained_context,
        "use_dynamic_ntk": config.dynamic_ntk,
        "use_logn_attn": config.logn_attn,
        "no_bias": True,
        "tie_word_embeddings": config.tie_word_embeddings,
    }


CONFIG_WRITERS = {"hf": hf_config_dict, "qwen": qwen_v1_config_dict}  # write_checkpoint's formats
