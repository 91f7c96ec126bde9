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

    def embed_labelled_points(self, coords: Tensor, labels: Tensor) -> Tensor:
        """Sparse embeddings [B, N, C] of labelled coordinates in model-input pixels: labels 1/0 are
        object/background points, 2/3 a box's corners, -1 "not a point" (its coordinates are ignored)."""
        emb = self.pe_layer.points(coords + 0.5, self.input_image_size)  # + 0.5: pixel centres
        emb = torch.where((labels == -1)[..., None], self.not_a_point_embed.weight.expand_as(emb), emb)
        for label, embedding in enumerate(self.point_embeddings):
            emb = emb + (labels == label)[..., None] * embedding.weight
        return emb

    def forward(self, points: tuple[Tensor, Tensor] | None, boxes: Tensor | None,
                masks: Tensor | None) -> tuple[Tensor, Tensor]:
        """Sparse [B, N, C] and dense [B, C, h, w] prompt embeddings."""
        bs = next((t.shape[0] for t in (points[0] if points else None, boxes, masks) if t is not None), 1)
        prompt = labelled_points(points, boxes)
        sparse = (self.embed_labelled_points(*prompt) if prompt is not None
                  else torch.empty((bs, 0, self.embed_dim), device=self.no_mask_embed.weight.device))
        if masks is not None:
            dense = self.mask_downscaling(masks)
        else:
            dense = self.no_mask_embed.weight.reshape(1, -1, 1, 1).expand(bs, -1, *self.image_embedding_size)
        return sparse, dense


def labelled_points(points: tuple[Tensor, Tensor] | None, boxes: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """Points and box as one list of labelled coordinates, in the order and with the labels of SAM's
    official ONNX decoder: the points (labels 1/0), then the box corners (labels 2, 3) or, without a
    box, one padding "not a point" (label -1) standing in for it. Labels come back as float32."""
    coords, labels = [], []
    if points is not None:
        coords.append(points[0].float())
        labels.append(points[1].float())
        if boxes is None:
            coords.append(torch.zeros_like(coords[0][:, :1]))
            labels.append(-torch.ones_like(labels[0][:, :1]))
    if boxes is not None:
        coords.append(boxes.float().reshape(-1, 2, 2))
        corners = torch.arange(2.0, 4.0, device=boxes.device)  # no host tensor: this runs inside CUDA graph capture
        labels.append(corners.expand(boxes.shape[0], 2))
    return (torch.cat(coords, 1), torch.cat(labels, 1)) if coords else None
