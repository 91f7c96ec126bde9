"""MobileSAM's image encoder: TinyViT-5M (Wu et al., 2022) distilled from SAM's ViT-H (Zhang et al., 2023).

A hierarchical encoder in place of SAM's plain ViT: a convolutional stem to 1/4 of the image, one stage
of MBConv blocks, then three stages of TinyViT blocks (window attention with a learned bias per relative
offset, a depthwise "local" convolution, an MLP), with patch merging between stages, and SAM's neck to
the 256-channel [B, 256, 64, 64] image embedding the prompt encoder and mask decoder expect. Every
convolution is followed by BatchNorm (used with its running statistics: this is an inference model).

Module and parameter names follow the official checkpoint (`image_encoder.patch_embed.seq.0.c.weight`,
`image_encoder.layers.1.blocks.0.attn.attention_biases`, …) so `mobile_sam.pt` loads as it is, but for the
keys `CHECKPOINT_KEYS_NOT_USED` lists.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.errors import UserError
from pipeline.sam.image_encoder import LayerNorm2d, window_partition, window_unpartition


@dataclasses.dataclass(frozen=True)
class TinyViTConfig:
    """Stage widths, depths, heads and windows; defaults are MobileSAM's (`build_sam_vit_t`)."""

    embed_dims: tuple[int, ...] = (64, 128, 160, 320)
    depths: tuple[int, ...] = (2, 2, 6, 2)
    num_heads: tuple[int, ...] = (2, 4, 5, 10)  # stage 0 is convolutional: its entry is unused
    window_sizes: tuple[int, ...] = (7, 7, 14, 7)
    # MobileSAM keeps the last merge at stride 1 so the output grid is 1/16 of the image, as SAM's ViT's is
    # (the official code hard-codes this for output widths 320, 448 and 576)
    merge_strides: tuple[int, ...] = (2, 2, 1)
    mlp_ratio: float = 4.0
    mbconv_expand_ratio: float = 4.0
    local_conv_size: int = 3


# Tensors of an official checkpoint that SAM's forward never reads (names after `image_encoder.`, `*` any
# block): the loader drops exactly these; any other key it does not know stays an error.
CHECKPOINT_KEYS_NOT_USED = {
    "norm_head.weight": "TinyViT's ImageNet classifier (LayerNorm before the head): MobileSAM's forward skips it",
    "norm_head.bias": "the same",
    "head.weight": "TinyViT's ImageNet classifier (a 320 → 1000 Linear): MobileSAM's forward skips it",
    "head.bias": "the same",
    "layers.*.blocks.*.attn.attention_bias_idxs": "each attention's offset index, where a checkpoint stores it "
                                                  "(mobile_sam.pt does not): ours is computed, and must equal it",
}


class ConvNorm(nn.Module):
    """Convolution without bias, then BatchNorm: TinyViT's only convolution unit (`Conv2d_BN`)."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 1, stride: int = 1, groups: int = 1):
        super().__init__()
        self.c = nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.c(x))


class PatchEmbed(nn.Module):
    """The stem: two stride-2 3×3 convolutions take the image to 1/4 of its size (not a 16×16 patchify)."""

    def __init__(self, c_in: int, dim: int):
        super().__init__()
        self.seq = nn.Sequential(ConvNorm(c_in, dim // 2, 3, 2), nn.GELU(), ConvNorm(dim // 2, dim, 3, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.seq(x)


class MBConv(nn.Module):
    """Inverted residual (expand 1×1, depthwise 3×3, project 1×1): the cheap first stage, at high resolution."""

    def __init__(self, dim: int, expand_ratio: float):
        super().__init__()
        hidden = int(dim * expand_ratio)
        self.conv1 = ConvNorm(dim, hidden)
        self.conv2 = ConvNorm(hidden, hidden, 3, groups=hidden)
        self.conv3 = ConvNorm(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        y = F.gelu(self.conv2(F.gelu(self.conv1(x))))
        return F.gelu(x + self.conv3(y))


class PatchMerging(nn.Module):
    """Between stages: widen (1×1), downsample (depthwise 3×3, `stride`), mix (1×1)."""

    def __init__(self, dim: int, out_dim: int, stride: int):
        super().__init__()
        self.conv1 = ConvNorm(dim, out_dim)
        self.conv2 = ConvNorm(out_dim, out_dim, 3, stride, groups=out_dim)
        self.conv3 = ConvNorm(out_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:  # NCHW → NCHW
        return self.conv3(F.gelu(self.conv2(F.gelu(self.conv1(x)))))


def offset_index(window: int) -> Tensor:
    """[w², w²]: for each query and key position of a w×w window, the index of their offset (|dy|, |dx|)
    in the attention-bias table, |dy|·w + |dx| (the order the official code numbers them in). Built on the
    CPU explicitly, so a model built on the meta device (as `load_sam` does) still gets a real index."""
    y, x = torch.meshgrid(torch.arange(window, device="cpu"), torch.arange(window, device="cpu"), indexing="ij")
    y, x = y.flatten(), x.flatten()
    return (y[:, None] - y[None, :]).abs() * window + (x[:, None] - x[None, :]).abs()


class WindowAttention(nn.Module):
    """Multi-head self-attention within a window, pre-normalised, with a learned bias per head for each
    relative offset (LeViT's attention biases) instead of position embeddings."""

    def __init__(self, dim: int, num_heads: int, window: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attention_biases = nn.Parameter(torch.zeros(num_heads, window * window))
        self.register_buffer("attention_bias_idxs", offset_index(window), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """[windows, w², dim] → the same. q, k and v lie per head in the projection ([heads, (q, k, v), d]),
        unlike SAM's ViT ([(q, k, v), heads, d])."""
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, self.num_heads, 3, -1).permute(3, 0, 2, 1, 4)
        bias = self.attention_biases[:, self.attention_bias_idxs].to(q.dtype)  # [heads, n, n]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # scale: head_dim^-0.5, as TinyViT's
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class MLP(nn.Module):
    """Pre-normalised two-layer MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyViTBlock(nn.Module):
    """Window attention, a depthwise local convolution (information across window borders), an MLP."""

    def __init__(self, dim: int, num_heads: int, window: int, mlp_ratio: float, local_conv_size: int):
        super().__init__()
        self.window = window
        self.attn = WindowAttention(dim, num_heads, window)
        self.local_conv = ConvNorm(dim, dim, local_conv_size, groups=dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor) -> Tensor:  # NHWC → NHWC
        b, h, w, c = x.shape
        # The grid is zero-padded to whole windows *before* the attention's LayerNorm, so padded positions
        # take part as keys (as LN(0) = its bias), as in the official model.
        windows, padded = window_partition(x, self.window)
        y = self.attn(windows.flatten(1, 2)).view_as(windows)
        x = x + window_unpartition(y, self.window, padded, (h, w))
        x = self.local_conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return x + self.mlp(x)


class ConvStage(nn.Module):
    """Stage 0: MBConv blocks, then patch merging to the next stage."""

    def __init__(self, dim: int, depth: int, expand_ratio: float, merge: PatchMerging):
        super().__init__()
        self.blocks = nn.ModuleList(MBConv(dim, expand_ratio) for _ in range(depth))
        self.downsample = merge

    def forward(self, x: Tensor) -> Tensor:  # NCHW → NCHW
        for block in self.blocks:
            x = block(x)
        return self.downsample(x)


class TransformerStage(nn.Module):
    """Stages 1–3: TinyViT blocks, then patch merging (but after the last stage)."""

    def __init__(self, dim: int, depth: int, num_heads: int, window: int, c: TinyViTConfig,
                 merge: PatchMerging | None):
        super().__init__()
        self.blocks = nn.ModuleList(TinyViTBlock(dim, num_heads, window, c.mlp_ratio, c.local_conv_size)
                                    for _ in range(depth))
        self.downsample = merge

    def forward(self, x: Tensor) -> Tensor:  # NCHW → NCHW
        x = x.permute(0, 2, 3, 1)
        for block in self.blocks:
            x = block(x)
        x = x.permute(0, 3, 1, 2)
        return x if self.downsample is None else self.downsample(x)


class TinyViT(nn.Module):
    """[B, 3, S, S] preprocessed pixels → [B, out_chans, S/16, S/16] image embedding (S = 1024 for SAM)."""

    def __init__(self, c: TinyViTConfig, img_size: int, out_chans: int):
        super().__init__()
        self.img_size = img_size
        grid = img_size // 4 // math.prod(c.merge_strides)
        if grid * 16 != img_size:
            raise ValueError(f"TinyViT's merge strides {c.merge_strides} give a {grid}-wide grid, not 1/16 of "
                             f"{img_size}")
        dims = c.embed_dims
        merges = [PatchMerging(dims[i], dims[i + 1], c.merge_strides[i]) for i in range(len(dims) - 1)]
        self.patch_embed = PatchEmbed(3, dims[0])
        self.layers = nn.ModuleList(
            [ConvStage(dims[0], c.depths[0], c.mbconv_expand_ratio, merges[0])]
            + [TransformerStage(dims[i], c.depths[i], c.num_heads[i], c.window_sizes[i], c,
                                merges[i] if i < len(merges) else None) for i in range(1, len(dims))])
        self.neck = nn.Sequential(
            nn.Conv2d(dims[-1], out_chans, kernel_size=1, bias=False), LayerNorm2d(out_chans),
            nn.Conv2d(out_chans, out_chans, kernel_size=3, padding=1, bias=False), LayerNorm2d(out_chans))

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.neck(x)


def drop_unused_keys(state: dict[str, Tensor], encoder: TinyViT, prefix: str = "image_encoder.") -> dict[str, Tensor]:
    """`state` without the keys `CHECKPOINT_KEYS_NOT_USED` names. A stored attention-bias index must equal
    ours (another would be another bias layout, which these weights were not trained with); one for a
    block we do not have is kept, so the strict load reports it."""
    ours = {prefix + k: v for k, v in encoder.named_buffers() if k.endswith("attention_bias_idxs")}
    kept = {}
    for key, value in state.items():
        if not any(fnmatch.fnmatchcase(key, prefix + pattern) for pattern in CHECKPOINT_KEYS_NOT_USED):
            kept[key] = value
        elif key.endswith("attention_bias_idxs"):
            if key not in ours:
                kept[key] = value
            elif not torch.equal(value.cpu(), ours[key].cpu()):
                raise UserError(f"this checkpoint's {key} orders the attention biases differently from "
                                f"TinyViT's (|dy|·w + |dx|): it is not a MobileSAM checkpoint")
    return kept
