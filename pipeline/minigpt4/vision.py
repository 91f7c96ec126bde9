"""MiniGPT-4's vision side: EVA ViT-g/14 → `ln_vision` → Q-Former (32 learned queries) → `llama_proj`.

Module and parameter names follow the original BLIP-2 / MiniGPT-4 checkpoints (`visual_encoder.*`,
`ln_vision.*`, `Qformer.bert.*`, `query_tokens`, `llama_proj.*`); `weights.py` maps the
transformers BLIP-2 names onto them. Only the Q-Former's query path exists: MiniGPT-4 never feeds
it text, so its text embeddings and text feed-forward layers are not built.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    img_size: int = 224
    patch_size: int = 14
    vit_width: int = 1408
    vit_depth: int = 39  # EVA ViT-g has 40 blocks; BLIP-2 / MiniGPT-4 use the first 39
    vit_heads: int = 16
    vit_mlp: int = 6144
    qformer_width: int = 768
    qformer_depth: int = 12
    qformer_heads: int = 12
    qformer_mlp: int = 3072
    cross_attention_freq: int = 2
    num_query_tokens: int = 32
    llm_width: int = 4096


# Widths keep the originals' head rules (ViT-g: width / 88 heads, Q-Former: width / 64) so the
# demo's sizes are read off its tensors exactly like real checkpoints'.
TINY = VisionConfig(vit_width=176, vit_depth=2, vit_heads=2, vit_mlp=352, qformer_width=128, qformer_depth=2,
                    qformer_heads=2, qformer_mlp=256, llm_width=64)


class EvaAttention(nn.Module):
    """EVA keeps q and v biases but no k bias (a k bias would not change the softmax anyway)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        bias = torch.cat([self.q_bias, torch.zeros_like(self.v_bias), self.v_bias])
        q, k, v = F.linear(x, self.qkv.weight, bias).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class EvaMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EvaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = EvaAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = EvaMlp(dim, mlp)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class EvaViT(nn.Module):
    """EVA ViT-g/14 as BLIP-2 uses it: class token, absolute positions, no final norm."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.patch_embed = PatchEmbed(c.patch_size, c.vit_width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.vit_width))
        self.pos_embed = nn.Parameter(torch.zeros(1, (c.img_size // c.patch_size) ** 2 + 1, c.vit_width))
        self.blocks = nn.ModuleList(EvaBlock(c.vit_width, c.vit_heads, c.vit_mlp) for _ in range(c.vit_depth))

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return x


class BertSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_dim: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(kv_dim, dim)
        self.value = nn.Linear(kv_dim, dim)

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        def split(t: Tensor) -> Tensor:
            return t.reshape(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(context)), split(self.value(context)))
        return y.transpose(1, 2).reshape(x.shape)


class BertOutput(nn.Module):
    """dense, then LayerNorm of the residual sum (BERT's post-norm)."""

    def __init__(self, dim_in: int, dim: int):
        super().__init__()
        self.dense = nn.Linear(dim_in, dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_dim: int):
        super().__init__()
        self.self = BertSelfAttention(dim, heads, kv_dim)
        self.output = BertOutput(dim, dim)

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        return self.output(self.self(x, context), x)


class BertIntermediate(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.dense = nn.Linear(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.dense(x))


class QFormerLayer(nn.Module):
    """Self-attention among the queries, cross-attention to the image (every `freq`-th layer), MLP."""

    def __init__(self, c: VisionConfig, cross: bool):
        super().__init__()
        self.attention = BertAttention(c.qformer_width, c.qformer_heads, c.qformer_width)
        if cross:
            self.crossattention = BertAttention(c.qformer_width, c.qformer_heads, c.vit_width)
        self.intermediate_query = BertIntermediate(c.qformer_width, c.qformer_mlp)
        self.output_query = BertOutput(c.qformer_mlp, c.qformer_width)
        self.cross = cross

    def forward(self, queries: Tensor, image: Tensor) -> Tensor:
        x = self.attention(queries, queries)
        if self.cross:
            x = self.crossattention(x, image)
        return self.output_query(self.intermediate_query(x), x)


class QFormerEmbeddings(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(dim, eps=1e-12)


class QFormerEncoder(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.layer = nn.ModuleList(QFormerLayer(c, i % c.cross_attention_freq == 0) for i in range(c.qformer_depth))


class QFormerBert(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.embeddings = QFormerEmbeddings(c.qformer_width)
        self.encoder = QFormerEncoder(c)

    def forward(self, queries: Tensor, image: Tensor) -> Tensor:
        x = self.embeddings.LayerNorm(queries)
        for layer in self.encoder.layer:
            x = layer(x, image)
        return x


class QFormer(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.bert = QFormerBert(c)


class MiniGPT4Vision(nn.Module):
    """Image [B, 3, 224, 224] (CLIP-normalised) → [B, 32, llm_width] embeddings for the LLM's prompt."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.visual_encoder = EvaViT(c)
        self.ln_vision = nn.LayerNorm(c.vit_width)
        self.Qformer = QFormer(c)
        self.query_tokens = nn.Parameter(torch.zeros(1, c.num_query_tokens, c.qformer_width))
        self.llama_proj = nn.Linear(c.qformer_width, c.llm_width)

    def image_features(self, pixels: Tensor) -> Tensor:
        """The Q-Former's 32 query outputs [B, 32, qformer_width] (before the LLM projection)."""
        image = self.ln_vision(self.visual_encoder(pixels))
        return self.Qformer.bert(self.query_tokens.expand(pixels.shape[0], -1, -1), image)

    def forward(self, pixels: Tensor) -> Tensor:
        return self.llama_proj(self.image_features(pixels))
