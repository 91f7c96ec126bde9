"""SAM's image encoder: a plain ViT with windowed and global attention and decomposed relative
positions, then a conv neck to the 256-channel image embedding (Kirillov et al., 2023).

Parameter names follow the official checkpoints (`image_encoder.blocks.N.attn.rel_pos_h`, …) so
`sam_vit_{b,l,h}_*.pth` load as they are. Attention runs through one SDPA call with the
relative-position terms folded into q and k (see `Attention.forward`), so no bias is materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LayerNorm2d(nn.Module):
    """LayerNorm over the channels of an NCHW map."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # One layer_norm over channels-last: exported as a single LayerNormalization, which TensorRT keeps
        # accurate under fp16, where a hand-written mean/variance would square in half precision.
        return F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, act: type[nn.Module] = nn.GELU):
        super().__init__()
        self.lin1 = nn.Linear(dim, hidden)
        self.lin2 = nn.Linear(hidden, dim)
        self.act = act()

    def forward(self, x: Tensor) -> Tensor:
        return self.lin2(self.act(self.lin1(x)))


def relative_positions(q_size: int, k_size: int, rel_pos: Tensor) -> Tensor:
    """Relative-position embeddings [q_size, k_size, dim], resized when the table is for another size."""
    max_dist = 2 * max(q_size, k_size) - 1
    if rel_pos.shape[0] != max_dist:
        rel_pos = F.interpolate(rel_pos.reshape(1, rel_pos.shape[0], -1).permute(0, 2, 1), size=max_dist,
                                mode="linear").reshape(-1, max_dist).permute(1, 0)
    q_coords = torch.arange(q_size, device=rel_pos.device)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size, device=rel_pos.device)[None, :] * max(q_size / k_size, 1.0)
    return rel_pos[((q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)).long()]


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, input_size: tuple[int, int]):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * input_size[0] - 1, head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * input_size[1] - 1, head_dim))

    def forward(self, x: Tensor) -> Tensor:
        """Attention with SAM's decomposed relative positions, folded into q and k.

        The position term of query i and key j is rel_h[i, row(j)] + rel_w[i, col(j)]. Rather than
        materialise it as an [hw, hw] bias per head (half a gigabyte per global layer at ViT-H),
        q gets rel_h and rel_w appended and k gets one-hot row and column indicators, so one
        plain attention call (flash kernels included) computes scale·q·k + both terms.
        """
        b, h, w, _ = x.shape
        qkv = self.qkv(x).reshape(b, h * w, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [b, heads, h*w, head_dim]
        head_dim = q.shape[-1]
        rh = relative_positions(h, h, self.rel_pos_h).to(q.dtype)
        rw = relative_positions(w, w, self.rel_pos_w).to(q.dtype)
        r_q = q.reshape(b, self.num_heads, h, w, head_dim)
        rel_h = torch.einsum("bnhwc,hkc->bnhwk", r_q, rh).reshape(b, self.num_heads, h * w, h)
        rel_w = torch.einsum("bnhwc,wkc->bnhwk", r_q, rw).reshape(b, self.num_heads, h * w, w)
        pad = -(head_dim + h + w) % 8  # fused kernels want head sizes in multiples of 8; the padding is zero
        rows = torch.eye(h, dtype=q.dtype, device=q.device).repeat_interleave(w, 0).expand(b, self.num_heads, -1, -1)
        cols = torch.eye(w, dtype=q.dtype, device=q.device).repeat(h, 1).expand(b, self.num_heads, -1, -1)
        zeros = q.new_zeros(b, self.num_heads, h * w, pad + h + w)
        q = torch.cat([q * head_dim ** -0.5, rel_h, rel_w, zeros[..., :pad]], -1)  # one copy per tensor
        k = torch.cat([k, rows, cols, zeros[..., :pad]], -1)
        v = torch.cat([v, zeros], -1)
        y = F.scaled_dot_product_attention(q, k, v, scale=1.0)[..., :head_dim]
        return self.proj(y.transpose(1, 2).reshape(b, h, w, -1))


def window_partition(x: Tensor, window: int) -> tuple[Tensor, tuple[int, int]]:
    b, h, w, c = x.shape
    pad_h, pad_w = (window - h % window) % window, (window - w % window) % window
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    hp, wp = h + pad_h, w + pad_w
    x = x.view(b, hp // window, window, wp // window, window, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window, window, c), (hp, wp)


def window_unpartition(x: Tensor, window: int, padded: tuple[int, int], size: tuple[int, int]) -> Tensor:
    hp, wp = padded
    b = x.shape[0] // (hp * wp // window // window)
    x = x.view(b, hp // window, wp // window, window, window, -1).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, hp, wp, -1)[:, :size[0], :size[1]].contiguous()


class Block(nn.Module):
    """Transformer block; `window_size` 0 means global attention over the whole token grid."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, window_size: int, input_size: tuple[int, int]):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, input_size if window_size == 0 else (window_size, window_size))
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLPBlock(dim, int(dim * mlp_ratio))
        self.window_size = window_size

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x
        x = self.norm1(x)
        if self.window_size > 0:
            h, w = x.shape[1], x.shape[2]
            x, padded = window_partition(x, self.window_size)
            x = window_unpartition(self.attn(x), self.window_size, padded, (h, w))
        else:
            x = self.attn(x)
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).permute(0, 2, 3, 1)  # NHWC


class ImageEncoderViT(nn.Module):
    def __init__(self, img_size: int, patch_size: int, embed_dim: int, depth: int, num_heads: int,
                 global_attn_indexes: tuple[int, ...], window_size: int, out_chans: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.img_size = img_size
        grid = img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, grid, grid, embed_dim))
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, 0 if i in global_attn_indexes else window_size, (grid, grid))
            for i in range(depth))
        self.neck = nn.Sequential(
            nn.Conv2d(embed_dim, out_chans, kernel_size=1, bias=False), LayerNorm2d(out_chans),
            nn.Conv2d(out_chans, out_chans, kernel_size=3, padding=1, bias=False), LayerNorm2d(out_chans))

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.neck(x.permute(0, 3, 1, 2))
