"""SAM's prompt encoder: points and box corners as random-Fourier positional encodings plus learned
type embeddings (sparse), a previous mask downscaled by convolutions (dense)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from pipeline.sam.image_encoder import LayerNorm2d


class PositionEmbeddingRandom(nn.Module):
    """Fourier features of normalised (x, y) through a fixed random Gaussian matrix."""

    def __init__(self, num_pos_feats: int):
        super().__init__()
        self.register_buffer("positional_encoding_gaussian_matrix", torch.randn(2, num_pos_feats))

    def _encode(self, coords: Tensor) -> Tensor:
        coords = (2 * coords - 1) @ self.positional_encoding_gaussian_matrix
        coords = 2 * math.pi * coords
        return torch.cat([coords.sin(), coords.cos()], dim=-1)

    def grid(self, size: tuple[int, int]) -> Tensor:
        """Encoding of every cell centre of an h×w grid: [C, h, w]."""
        h, w = size
        device = self.positional_encoding_gaussian_matrix.device
        y = (torch.arange(h, device=device, dtype=torch.float32) + 0.5) / h
        x = (torch.arange(w, device=device, dtype=torch.float32) + 0.5) / w
        xy = torch.stack(torch.meshgrid(x, y, indexing="xy"), dim=-1)
        return self._encode(xy).permute(2, 0, 1)

    def points(self, coords: Tensor, image_size: tuple[int, int]) -> Tensor:
        """Encoding of pixel coordinates (x, y) in an image of `image_size` (h, w)."""
        coords = coords.clone().float()
        coords[..., 0] = coords[..., 0] / image_size[1]
        coords[..., 1] = coords[..., 1] / image_size[0]
        return self._encode(coords)


class PromptEncoder(nn.Module):
    def __init__(self, embed_dim: int, image_embedding_size: tuple[int, int], input_image_size: tuple[int, int],
                 mask_in_chans: int):
        super().__init__()
        self.embed_dim = embed_dim
        self.image_embedding_size = image_embedding_size
        self.input_image_size = input_image_size
        self.pe_layer = PositionEmbeddingRandom(embed_dim // 2)
        # 0: negative point, 1: positive point, 2: box top-left, 3: box bottom-right
        self.point_embeddings = nn.ModuleList(nn.Embedding(1, embed_dim) for _ in range(4))
        self.not_a_point_embed = nn.Embedding(1, embed_dim)
        self.mask_downscaling = nn.Sequential(
            nn.Conv2d(1, mask_in_chans // 4, kernel_size=2, stride=2), LayerNorm2d(mask_in_chans // 4), nn.GELU(),
            nn.Conv2d(mask_in_chans // 4, mask_in_chans, kernel_size=2, stride=2), LayerNorm2d(mask_in_chans),
            nn.GELU(), nn.Conv2d(mask_in_chans, embed_dim, kernel_size=1))
        self.no_mask_embed = nn.Embedding(1, embed_dim)

    def get_dense_pe(self) -> Tensor:
        """Positional encoding of the image embedding's grid: [1, C, h, w]."""
        return self.pe_layer.grid(self.image_embedding_size)[None]

    def _embed_points(self, points: Tensor, labels: Tensor, pad: bool) -> Tensor:
        points = points + 0.5  # pixel centres
        if pad:  # without a box, a padding "not a point" token stands in for it
            points = torch.cat([points, torch.zeros_like(points[:, :1])], dim=1)
            labels = torch.cat([labels, -torch.ones_like(labels[:, :1])], dim=1)
        emb = self.pe_layer.points(points, self.input_image_size)
        emb = torch.where((labels == -1)[..., None], self.not_a_point_embed.weight.expand_as(emb), emb)
        emb = emb + (labels == 0)[..., None] * self.point_embeddings[0].weight
        return emb + (labels == 1)[..., None] * self.point_embeddings[1].weight

    def _embed_boxes(self, boxes: Tensor) -> Tensor:
        corners = self.pe_layer.points((boxes + 0.5).reshape(-1, 2, 2), self.input_image_size)
        return corners + torch.cat([self.point_embeddings[2].weight, self.point_embeddings[3].weight])[None]

    def forward(self, points: tuple[Tensor, Tensor] | None, boxes: Tensor | None,
                masks: Tensor | None) -> tuple[Tensor, Tensor]:
        """Sparse [B, N, C] and dense [B, C, h, w] prompt embeddings."""
        bs = next((t.shape[0] for t in (points[0] if points else None, boxes, masks) if t is not None), 1)
        device = self.no_mask_embed.weight.device
        sparse = [torch.empty((bs, 0, self.embed_dim), device=device)]
        if points is not None:
            sparse.append(self._embed_points(points[0], points[1], pad=boxes is None))
        if boxes is not None:
            sparse.append(self._embed_boxes(boxes))
        if masks is not None:
            dense = self.mask_downscaling(masks)
        else:
            dense = self.no_mask_embed.weight.reshape(1, -1, 1, 1).expand(bs, -1, *self.image_embedding_size)
        return torch.cat(sparse, dim=1), dense
