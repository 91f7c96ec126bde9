"""BERT's encoder (Devlin et al. 2019), the network behind the sentence-transformers embedders, in the three
forms published embedders take:
- BERT itself (all-MiniLM-L6-v2, bge-small/base): learned positions, biased projections, a GELU feed-forward;
- XLM-RoBERTa (Conneau et al. 2020: multilingual-e5, bge-m3): the same, positions counted from past the padding id;
- NomicBERT (Nussbaum et al. 2024: nomic-embed-text-v1.5): rotary positions instead of a table, no biases in the
  projections, a SwiGLU feed-forward.
Token and segment embeddings summed and normalized, then post-norm layers of bidirectional self-attention and a
feed-forward. The differences are switches on `BertConfig`; one readable module. A checkpoint's names are mapped
onto it by a table per layout (`LAYOUTS`), so the folder's code is never run.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.errors import UserError


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    first_position: int = 0  # XLM-RoBERTa's positions start past its padding id (pad_token_id + 1)
    rotary_base: float = 0.0  # NomicBERT: rotary positions of this base (0: a learned table)
    gated: bool = False  # NomicBERT: SiLU(gate)·up feed-forward instead of GELU(up)
    bias: bool = True  # biases on the attention and feed-forward projections
    layout: str = "bert"  # the checkpoint's names (`LAYOUTS`)

    @classmethod
    def from_hf(cls, cfg: dict) -> BertConfig:
        """A transformers `config.json` of `model_type` bert, roberta, xlm-roberta or nomic_bert (as
        nomic-ai publishes it, GPT-2's key names, or as transformers 5 writes it)."""
        if cfg.get("model_type") == "nomic_bert":
            return _nomic_config(cfg)
        roberta = cfg.get("model_type") in ("roberta", "xlm-roberta")
        return cls(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                   cfg["intermediate_size"], cfg["max_position_embeddings"], cfg.get("type_vocab_size", 2),
                   cfg.get("layer_norm_eps", 1e-12), cfg.get("pad_token_id", 1) + 1 if roberta else 0)


def _nomic_config(cfg: dict) -> BertConfig:
    """NomicBERT's config. nomic-ai's folders name the sizes as GPT-2 does (n_embd, n_layer, …) with switches
    for variants its code supports; the ones nomic-embed-text uses are run, any other is refused by name."""
    if "n_embd" not in cfg:  # as transformers 5 writes it
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise UserError(f"its rotary positions are scaled ({rope.get('rope_type')}), which is not run here")
        return BertConfig(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                          cfg["intermediate_size"], cfg.get("max_position_embeddings", 2048),
                          cfg.get("type_vocab_size", 2), cfg.get("layer_norm_eps", 1e-12),
                          rotary_base=float(rope.get("rope_theta", 1000.0)), gated=True, bias=False, layout="nomic")
    unsupported = [key for key, value in (("prenorm", True), ("rotary_emb_interleaved", True), ("qkv_proj_bias", True),
                                          ("mlp_fc1_bias", True), ("mlp_fc2_bias", True), ("use_rms_norm", True),
                                          ("causal", True)) if cfg.get(key) == value]
    if cfg.get("rotary_emb_fraction", 1.0) != 1.0:
        unsupported.append("rotary_emb_fraction")
    if cfg.get("activation_function", "swiglu") != "swiglu":
        unsupported.append(f"activation_function {cfg.get('activation_function')}")
    if cfg.get("num_experts"):
        unsupported.append("num_experts")
    if unsupported:
        raise UserError(f"its config asks for {', '.join(unsupported)}: NomicBERT runs here as nomic-embed-text "
                        f"uses it (post-norm, rotary over whole heads, SwiGLU, no biases)")
    # past the positions it was trained on, nomic's code stretches the rotary base (`rotary_scaling_factor`):
    # texts are kept within them instead
    positions = min(cfg.get("max_trained_positions") or cfg.get("n_positions", 2048), cfg.get("n_positions", 2048))
    return BertConfig(cfg["vocab_size"], cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_inner"], positions,
                      cfg.get("type_vocab_size", 2), cfg.get("layer_norm_epsilon", 1e-12),
                      rotary_base=float(cfg.get("rotary_emb_base", 10000.0)), gated=True, bias=False, layout="nomic")


class Embeddings(nn.Module):
    """A token's embedding, plus its position's (where positions are a table) and its segment's (the first for
    one text; a cross-encoder's pair of texts gives the second its own)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.first_position = c.first_position
        self.token = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = None if c.rotary_base else nn.Embedding(c.max_positions, c.hidden_size)
        self.segment = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        x = self.token(ids) + (self.segment.weight[0] if segments is None else self.segment(segments))
        if self.position is not None:
            x = x + self.position(torch.arange(self.first_position, self.first_position + ids.shape[1],
                                               device=ids.device))
        return self.norm(x)


def rotary_tables(c: BertConfig, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin [length, head_dim] for rotating each head's halves (not interleaved pairs), positions from 0."""
    head_dim = c.hidden_size // c.num_heads
    frequencies = 1.0 / c.rotary_base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), frequencies)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


class SelfAttention(nn.Module):
    """Every token attends to every other token of its text (padding masked out); q, k and v in one GEMM."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.heads = c.num_heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=c.bias)
        self.out = nn.Linear(c.hidden_size, c.hidden_size, bias=c.bias)

    def forward(self, x: Tensor, keep: Tensor, rotary: tuple[Tensor, Tensor] | None) -> Tensor:
        b, s, width = x.shape
        q, k, v = (t.view(b, s, self.heads, width // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if rotary is not None:
            q, k = rotate(q, *rotary), rotate(k, *rotary)
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(mixed.transpose(1, 2).reshape(b, s, width))


class EncoderLayer(nn.Module):
    """Self-attention then the feed-forward, each added to its input and layer-normalized after (post-norm)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = SelfAttention(c)
        self.attention_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.up = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.bias)
        self.gate = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.bias) if c.gated else None
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.bias)
        self.output_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: Tensor, keep: Tensor, rotary: tuple[Tensor, Tensor] | None) -> Tensor:
        x = self.attention_norm(x + self.attention(x, keep, rotary))
        inner = F.gelu(self.up(x)) if self.gate is None else F.silu(self.gate(x)) * self.up(x)
        return self.output_norm(x + self.down(inner))


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.config = c
        self.embeddings = Embeddings(c)
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.num_layers))

    def forward(self, ids: Tensor, mask: Tensor, segments: Tensor | None = None) -> Tensor:
        """ids, mask [B, S] (mask 1 for a token, 0 for padding; `segments`: each token's text of a pair) → every
        token's last hidden state [B, S, H]."""
        keep = mask[:, None, None, :].bool()
        rotary = rotary_tables(self.config, ids.shape[1], ids.device) if self.config.rotary_base else None
        x = self.embeddings(ids, segments)
        for layer in self.layers:
            x = layer(x, keep, rotary)
        return x


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a checkpoint format keeps each tensor: our name → the checkpoint's names, concatenated along the
    outputs where we fuse what it keeps apart (BERT's query, key and value)."""

    embeddings: dict[str, str]
    layer: str  # prefix with {} for the layer index
    layers: dict[str, tuple[str, ...]]


# transformers' BertModel and XLMRobertaModel (a "bert." or "roberta." prefix, as a …For… head model has, is
# dropped), and NomicBERT as nomic-ai publishes it (transformers 5 writes the same names)
LAYOUTS = {
    "bert": Layout(
        embeddings={"token": "embeddings.word_embeddings", "position": "embeddings.position_embeddings",
                    "segment": "embeddings.token_type_embeddings", "norm": "embeddings.LayerNorm"},
        layer="encoder.layer.{}.",
        layers={"attention.qkv": ("attention.self.query", "attention.self.key", "attention.self.value"),
                "attention.out": ("attention.output.dense",), "attention_norm": ("attention.output.LayerNorm",),
                "up": ("intermediate.dense",), "down": ("output.dense",), "output_norm": ("output.LayerNorm",)}),
    "nomic": Layout(
        embeddings={"token": "embeddings.word_embeddings", "segment": "embeddings.token_type_embeddings",
                    "norm": "emb_ln"},
        layer="encoder.layers.{}.",
        layers={"attention.qkv": ("attn.Wqkv",), "attention.out": ("attn.out_proj",), "attention_norm": ("norm1",),
                "up": ("mlp.fc11",), "gate": ("mlp.fc12",), "down": ("mlp.fc2",), "output_norm": ("norm2",)}),
}


def checkpoint_names(model: BertEncoder) -> dict[str, tuple[str, ...]]:
    """Every parameter of `model` → its names in the checkpoint (concatenated in that order)."""
    layout = LAYOUTS[model.config.layout]
    names = {}
    for name, _ in model.named_parameters():
        module, _, kind = name.rpartition(".")
        if module.startswith("embeddings."):
            names[name] = (f"{layout.embeddings[module.removeprefix('embeddings.')]}.{kind}",)
        else:
            _, index, part = module.split(".", 2)
            names[name] = tuple(f"{layout.layer.format(index)}{theirs}.{kind}" for theirs in layout.layers[part])
    return names
