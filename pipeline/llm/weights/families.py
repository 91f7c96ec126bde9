"""The decoder families we read and write, in one table that config parsing, checkpoint layouts and
writers all read, so adding a family (or fixing one) is one row, not four places that must agree.
"""

from __future__ import annotations

import dataclasses

from pipeline.errors import UserError


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a checkpoint format keeps each decoder tensor. `renames` maps per-layer decoder names to
    the format's; `qkv` and `gate_up` name the pieces our fused tensors are concatenated from."""

    embed: str
    norm: str
    layer: str  # prefix with {} for the layer index
    renames: dict[str, str]
    gate_up: tuple[str, str]
    qkv: tuple[str, str, str] | None = None  # None: the format fuses q/k/v as we do (and renames it)

    def projections(self) -> dict[str, tuple[str, ...]]:
        """Per block, the format's linear modules (name prefixes, "mlp.down_proj.") each of our four
        projections concatenates along its outputs: what the weight loaders fuse, float or quantized."""
        def module(name: str) -> str:
            return name.removesuffix("weight")

        return {"attn.wqkv": self.qkv or (module(self.renames["attn.wqkv.weight"]),),
                "attn.wo": (module(self.renames["attn.wo.weight"]),),
                "mlp.w_gate_up": tuple(map(module, self.gate_up)),
                "mlp.w_down": (module(self.renames["mlp.w_down.weight"]),)}


HF_LAYOUT = Layout(
    embed="model.embed_tokens.weight", norm="model.norm.weight", layer="model.layers.{}.",
    renames={"attn.wo.weight": "self_attn.o_proj.weight", "attn.wo.bias": "self_attn.o_proj.bias",
             "attn_norm.weight": "input_layernorm.weight",
             "mlp_norm.weight": "post_attention_layernorm.weight", "mlp.w_down.weight": "mlp.down_proj.weight",
             "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"},
    gate_up=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    qkv=("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj."),
)
# Qwen v1 computes w1(x) * silu(w2(x)): w2 is the gate, w1 the up projection.
QWEN_V1_LAYOUT = Layout(
    embed="transformer.wte.weight", norm="transformer.ln_f.weight", layer="transformer.h.{}.",
    renames={"attn.wqkv.weight": "attn.c_attn.weight", "attn.wqkv.bias": "attn.c_attn.bias",
             "attn.wo.weight": "attn.c_proj.weight", "attn_norm.weight": "ln_1.weight",
             "mlp_norm.weight": "ln_2.weight", "mlp.w_down.weight": "mlp.c_proj.weight"},
    gate_up=("mlp.w2.weight", "mlp.w1.weight"),
)

# TensorRT-LLM's checkpoint names (Llama and Qwen2 alike, `models/llama/convert.py`, `models/qwen/utils.py`, 0.21–1.2):
# q/k/v fused as we fuse them; `mlp.fc` is the gate (the activation applies to it), `mlp.gate` the up projection.
TRTLLM_LAYOUT = Layout(
    embed="transformer.vocab_embedding.weight", norm="transformer.ln_f.weight", layer="transformer.layers.{}.",
    renames={"attn.wqkv.weight": "attention.qkv.weight", "attn.wqkv.bias": "attention.qkv.bias",
             "attn.wo.weight": "attention.dense.weight", "attn.wo.bias": "attention.dense.bias",
             "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_layernorm.weight", "mlp.w_down.weight": "mlp.proj.weight",
             "attn.q_norm.weight": "attention.q_layernorm.weight", "attn.k_norm.weight": "attention.k_layernorm.weight"},
    gate_up=("mlp.fc.weight", "mlp.gate.weight"),
)


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str  # config.json's `model_type`, and `DecoderConfig.family`
    name: str  # as users know it
    architecture: str  # config.json's `architectures`
    layout: Layout  # where its checkpoints keep each tensor
    qkv_bias: bool | None  # None: as config.json's `attention_bias` says
    qk_norm: bool
    transformers_type: str  # the `model_type` it is written as in transformers format (its closest kin)

    @property
    def is_transformers(self) -> bool:
        """Whether its own checkpoints are transformers ones (else: Qwen v1's own config and names)."""
        return self.transformers_type == self.model_type


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen", "Qwen v1", "QWenLMHeadModel", QWEN_V1_LAYOUT, qkv_bias=True, qk_norm=False,
           transformers_type="qwen2"),
    Family("qwen2", "Qwen2/2.5", "Qwen2ForCausalLM", HF_LAYOUT, qkv_bias=True, qk_norm=False,
           transformers_type="qwen2"),
    Family("qwen3", "Qwen3", "Qwen3ForCausalLM", HF_LAYOUT, qkv_bias=None, qk_norm=True, transformers_type="qwen3"),
    Family("llama", "LLaMA/Vicuna", "LlamaForCausalLM", HF_LAYOUT, qkv_bias=None, qk_norm=False,
           transformers_type="llama"),
)}
QWEN_V1 = FAMILIES["qwen"]


def family_of(model_type: str | None) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise UserError(f"model_type {model_type!r} is not supported; supported: "
                        f"{', '.join(f.name for f in FAMILIES.values())}") from None
