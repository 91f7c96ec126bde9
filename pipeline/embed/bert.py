"""BERT's encoder (Devlin et al. 2019), the network behind the sentence-transformers embedders (all-MiniLM-L6-v2,
bge-small/base) and, with positions counted from past the padding id, XLM-RoBERTa's (Conneau et al. 2020:
multilingual-e5, bge-m3): token, position and segment embeddings summed and normalized, then post-norm layers of
bidirectional self-attention and a GELU feed-forward. One readable module; the checkpoint's names are mapped onto
it by a table (`CHECKPOINT_NAMES`), so the folder's code is never run.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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

    @classmethod
    def from_hf(cls, cfg: dict) -> BertConfig:
        """A transformers `config.json` of `model_type` bert, roberta or xlm-roberta."""
        roberta = cfg.get("model_type") in ("roberta", "xlm-roberta")
        return cls(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                   cfg["intermediate_size"], cfg["max_position_embeddings"], cfg.get("type_vocab_size", 2),
                   cfg.get("layer_norm_eps", 1e-12), cfg.get("pad_token_id", 1) + 1 if roberta else 0)


class Embeddings(nn.Module):
    """A token's embedding, plus its position's and its segment's (the first for one text; a cross-encoder's
    pair of texts gives the second its own)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.first_position = c.first_position
        self.token = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.max_positions, c.hidden_size)
        self.segment = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        positions = torch.arange(self.first_position, self.first_position + ids.shape[1], device=ids.device)
        segment = self.segment.weight[0] if segments is None else self.segment(segments)
        return self.norm(self.token(ids) + self.position(positions) + segment)


class SelfAttention(nn.Module):
    """Every token attends to every other token of its text (padding masked out)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.heads = c.num_heads
        self.q, self.k, self.v = (nn.Linear(c.hidden_size, c.hidden_size) for _ in range(3))
        self.out = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        b, s, width = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(b, s, self.heads, width // self.heads).transpose(1, 2)

        mixed = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), attn_mask=keep)
        return self.out(mixed.transpose(1, 2).reshape(b, s, width))


class EncoderLayer(nn.Module):
    """Self-attention then the feed-forward, each added to its input and layer-normalized after (post-norm)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = SelfAttention(c)
        self.attention_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.up = nn.Linear(c.hidden_size, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size)
        self.output_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        x = self.attention_norm(x + self.attention(x, keep))
        return self.output_norm(x + self.down(F.gelu(self.up(x))))


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
        x = self.embeddings(ids, segments)
        for layer in self.layers:
            x = layer(x, keep)
        return x


# our name → the checkpoint's (transformers' BertModel and XLMRobertaModel; a "bert." or "roberta." prefix, as a
# …For… head model has, is dropped)
CHECKPOINT_NAMES = {
    "embeddings.token.weight": "embeddings.word_embeddings.weight",
    "embeddings.position.weight": "embeddings.position_embeddings.weight",
    "embeddings.segment.weight": "embeddings.token_type_embeddings.weight",
    "embeddings.norm.weight": "embeddings.LayerNorm.weight",
    "embeddings.norm.bias": "embeddings.LayerNorm.bias",
}
LAYER_NAMES = {
    "attention.q": "attention.self.query",
    "attention.k": "attention.self.key",
    "attention.v": "attention.self.value",
    "attention.out": "attention.output.dense",
    "attention_norm": "attention.output.LayerNorm",
    "up": "intermediate.dense",
    "down": "output.dense",
    "output_norm": "output.LayerNorm",
}


def checkpoint_names(c: BertConfig) -> dict[str, str]:
    """Every parameter of `BertEncoder(c)` → its name in the checkpoint."""
    names = dict(CHECKPOINT_NAMES)
    for i in range(c.num_layers):
        for ours, theirs in LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{ours}.{kind}"] = f"encoder.layer.{i}.{theirs}.{kind}"
    return names
