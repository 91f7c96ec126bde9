"""SmolVLM's vision side: SigLIP ViT (NaViT-style positions for partial grids) → pixel shuffle → projection.

Each image tile [3, S, S] becomes (S / patch)² patch embeddings; a learned table gives their positions.
A tile may be padded (its pixel mask says which pixels are real): its real patches are spread over
the whole position table by bucketing their fractional coordinates (Patch n' Pack, NaViT), and padded
patches are hidden from attention as keys. The connector trades sequence length for width (pixel
shuffle: each s×s block of patches becomes one token of s²× the width), then one linear maps that to
the decoder's width, so a tile costs (S / patch / s)² prompt positions.

Parameter names follow the papers' parts; `weights.py` maps transformers' Idefics3 names onto them.
q/k/v are one GEMM (`attn.qkv`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """SmolVLM-256M/500M's shapes by default (SigLIP-B/16 at 512 px, 4× shuffle, a 576-wide decoder)."""

    image_size: int = 512  # a tile's side: the position table is (image_size / patch_size)² entries
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    heads: int = 12
    mlp: int = 3072
    eps: float = 1e-6
    gelu: str = "tanh"  # F.gelu's `approximate`: "tanh" (gelu_pytorch_tanh) or "none" (exact gelu)
    scale_factor: int = 4  # the pixel shuffle's block side
    text_width: int = 576

    @property
    def per_side(self) -> int:
        """Patches along a full tile's side (and the position table's side)."""
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        """Prompt positions one tile takes after the pixel shuffle (the processor's `image_seq_len`)."""
        return (self.per_side // self.scale_factor) ** 2


def patch_mask_of(pixel_mask: Tensor, patch: int) -> Tensor:
    """[T, H, W] pixel mask → [T, H/patch, W/patch] bool: a patch is real if any pixel in it is."""
    t, h, w = pixel_mask.shape
    rows, cols = h // patch, w // patch
    blocks = pixel_mask[:, :rows * patch, :cols * patch].reshape(t, rows, patch, cols, patch)
    return blocks.bool().any(dim=4).any(dim=2)


def patch_positions(patch_mask: Tensor, per_side: int) -> Tensor:
    """Position ids [T, rows * cols] for each tile's patch grid [T, rows, cols] (True: real patch).

    A tile with n real patch rows puts row i at the fraction i / n of the table's side and takes the
    bucket it falls in (of `per_side`), so a small or padded tile still spans the whole table; padded
    patches get position 0 (they are never attended to). The real patches are counted along the first
    column and row: padding is at the bottom and right. Boundaries and fractions are float32, as the
    model was trained with them: the bucket of an exact boundary depends on their rounding.
    """
    t, rows, cols = patch_mask.shape
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, device=patch_mask.device)
    real_rows = patch_mask[:, :, 0].sum(dim=1)
    real_cols = patch_mask[:, 0, :].sum(dim=1)

    def buckets(count: int, real: Tensor) -> Tensor:
        fraction = torch.arange(count, dtype=torch.float32, device=real.device)[None] * (1.0 / real)[:, None]
        return torch.bucketize(fraction.clamp(max=1.0 - 1e-6), boundaries, right=True)

    ids = buckets(rows, real_rows)[:, :, None] * per_side + buckets(cols, real_cols)[:, None, :]
    return torch.where(patch_mask, ids, 0).reshape(t, rows * cols)


class Embeddings(nn.Module):
    """Patchify by a strided convolution, add the learned position of each patch."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.per_side = c.per_side
        self.patch_embed = nn.Conv2d(3, c.width, kernel_size=c.patch_size, stride=c.patch_size)
        self.pos_embed = nn.Embedding(c.per_side ** 2, c.width)

    def forward(self, pixels: Tensor, patch_mask: Tensor) -> Tensor:
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        return x + self.pos_embed(patch_positions(patch_mask, self.per_side))


class Attention(nn.Module):
    """Bidirectional multi-head attention; `key_mask` [T, N] hides padded patches as keys."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        t, n, width = x.shape
        q, k, v = self.qkv(x).view(t, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(t, n, width))


class Mlp(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.approximate = c.gelu
        self.fc1 = nn.Linear(c.width, c.mlp)
        self.fc2 = nn.Linear(c.mlp, c.width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class Block(nn.Module):
    """A pre-norm ViT block: x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.width, eps=c.eps)
        self.attn = Attention(c)
        self.norm2 = nn.LayerNorm(c.width, eps=c.eps)
        self.mlp = Mlp(c)

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.mlp(self.norm2(x))


class SiglipEncoder(nn.Module):
    """SigLIP's ViT without its pooling head: the patch sequence after the final LayerNorm."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.embeddings = Embeddings(c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.norm = nn.LayerNorm(c.width, eps=c.eps)

    def forward(self, pixels: Tensor, patch_mask: Tensor, padded: bool) -> Tensor:
        """`padded` False: every patch is real, so attention needs no mask (faster SDPA, nothing to sync)."""
        x = self.embeddings(pixels, patch_mask)
        key_mask = patch_mask.flatten(1) if padded else None
        for block in self.blocks:
            x = block(x, key_mask)
        return self.norm(x)


def pixel_shuffle(x: Tensor, s: int) -> Tensor:
    """[T, h*w, D] patches on a square grid → [T, (h/s)*(w/s), s*s*D]: each s×s block of neighbours
    becomes one token, row-major over the blocks, its features ordered (row in block, column in block, D)."""
    t, n, d = x.shape
    side = int(round(n ** 0.5))
    blocks = x.view(t, side // s, s, side // s, s, d).permute(0, 1, 3, 2, 4, 5)
    return blocks.reshape(t, (side // s) ** 2, s * s * d)


class Connector(nn.Module):
    """Pixel shuffle, then the modality projection into the decoder's embedding space (no bias)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.scale_factor = c.scale_factor
        self.proj = nn.Linear(c.width * c.scale_factor ** 2, c.text_width, bias=False)

    def forward(self, patches: Tensor) -> Tensor:
        return self.proj(pixel_shuffle(patches, self.scale_factor))


class SmolVLMVision(nn.Module):
    """Tiles [T, 3, S, S] (normalised, with an optional pixel mask [T, S, S]) → the decoder's image
    embeddings [T, tokens_per_image, text_width], in the tiles' order."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.encoder = SiglipEncoder(c)
        self.connector = Connector(c)

    def forward(self, pixels: Tensor, pixel_mask: Tensor | None = None) -> Tensor:
        """`pixel_mask` None: whole tiles (what `preprocess` makes), run without a host sync, so capturable."""
        weight = self.connector.proj.weight
        pixels = pixels.to(weight.device, weight.dtype)
        p = self.config.patch_size
        if pixel_mask is None:
            patch_mask = torch.ones(pixels.shape[0], pixels.shape[2] // p, pixels.shape[3] // p, dtype=torch.bool,
                                    device=pixels.device)
            return self.connector(self.encoder(pixels, patch_mask, padded=False))
        patch_mask = patch_mask_of(pixel_mask.to(pixels.device), p)
        return self.connector(self.encoder(pixels, patch_mask, padded=not bool(patch_mask.all())))
