"""Qwen2.5-VL's vision tower: patches → ViT with windowed attention and 2-D rotary positions → merger.

The processor hands over patches grouped by merge cell (m × m neighbouring patches that become one LLM
token). The tower moves whole cells into window order (windows of `window_size` pixels, row-major over
the image, cells row-major inside; the windows at the right and bottom edges are partial), so that
each attention window is one contiguous run. Most blocks attend within a window; the blocks in
`fullatt_block_indexes` attend over each whole frame. Positions are rotary: a quarter of each head's
dimensions turn with the patch's row, a quarter with its column (both again for the rotated half).
At the end the merger joins each cell's m² patches into one token of the decoder's width, and the
tokens go back to the processor's (row-major) order.

Parameter names follow transformers' where they name the parts; `weights.py` maps the checkpoints.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = {"silu": F.silu}  # vision_config.hidden_act → the MLP's gate activation
EPS = 1e-6  # every RMSNorm of the tower
Grid = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Qwen2.5-VL-7B's vision tower by default (3B and 72B differ only in `out_hidden_size`)."""

    depth: int = 32
    hidden_size: int = 1280
    num_heads: int = 16
    intermediate_size: int = 3420
    out_hidden_size: int = 3584  # the decoder's width
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112  # in pixels: a window is window_size // merge // patch cells a side
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    in_channels: int = 3
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window_cells(self) -> int:
        """A window's side in merge cells."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels × time × rows × columns."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


@dataclasses.dataclass(frozen=True)
class Segments:
    """Runs of a flat sequence that attend only among themselves, laid out for one batched SDPA call:
    token i goes to row `slots[i] // width`, column `slots[i] % width`; `mask` [runs, width] marks the
    real entries (None: every run fills its row)."""

    slots: Tensor
    runs: int
    width: int
    mask: Tensor | None

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> Segments:
        """Planned on the CPU (no device syncs), then moved."""
        sizes = torch.tensor(lengths)
        width = max(lengths)
        run = torch.repeat_interleave(torch.arange(len(lengths)), sizes)
        offset = torch.arange(len(run)) - (torch.cumsum(sizes, 0) - sizes)[run]
        mask = None if min(lengths) == width else torch.arange(width)[None] < sizes[:, None]
        return cls((run * width + offset).to(device), len(lengths), width, None if mask is None else mask.to(device))


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the grids decide, computed once per forward: the cells' window order and its inverse, each
    patch's (row, column) in window order, and the attention runs of window and full blocks."""

    order: Tensor  # [cells]: window order → the processor's cell index
    inverse: Tensor  # [cells]: the processor's cell index → window order
    positions: Tensor  # [patches, 2]
    windows: Segments
    frames: Segments


def cell_positions(h: int, w: int, m: int) -> Tensor:
    """(row, column) of each patch of an h × w patch grid in the processor's order: [h*w, 2]."""
    rows = torch.arange(h).view(h // m, 1, m, 1).expand(h // m, w // m, m, m)
    cols = torch.arange(w).view(1, w // m, 1, m).expand(h // m, w // m, m, m)
    return torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=1)


def window_order(t: int, rows: int, cols: int, side: int) -> tuple[Tensor, Tensor]:
    """The cells of t frames of rows × cols cells in window order, and each window's cell count: the
    grid is padded to whole windows, then read window by window, skipping the padding."""
    cells = torch.arange(t * rows * cols).view(t, rows, cols)
    padded = F.pad(cells, (0, -cols % side, 0, -rows % side), value=-1)
    n_rows, n_cols = padded.shape[1] // side, padded.shape[2] // side
    windows = padded.view(t, n_rows, side, n_cols, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
    real = windows >= 0
    return windows[real], real.sum(dim=1)


def layout(grids: list[Grid], c: VisionConfig, device: torch.device) -> Layout:
    m2 = c.spatial_merge_size ** 2
    orders, windows, positions, frames, start = [], [], [], [], 0
    for t, h, w in grids:
        order, sizes = window_order(t, h // c.spatial_merge_size, w // c.spatial_merge_size, c.window_cells)
        orders.append(order + start)
        windows += (sizes * m2).tolist()
        positions.append(cell_positions(h, w, c.spatial_merge_size).repeat(t, 1))
        frames += [h * w] * t
        start += t * h * w // m2
    order = torch.cat(orders)
    patch_order = (order[:, None] * m2 + torch.arange(m2)).reshape(-1)  # cells move with their m² patches
    return Layout(order.to(device), torch.argsort(order).to(device), torch.cat(positions)[patch_order].to(device),
                  Segments.of(windows, device), Segments.of(frames, device))


class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        """Normalised in float32, scaled in the input's dtype."""
        y = x.float()
        return self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class PatchEmbed(nn.Module):
    """A Conv3d with kernel = stride = (T, P, P) and no bias, over inputs that are one kernel each: a
    matmul with the kernel flattened as the patches are (channel, time, row, column)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.hidden_size, c.in_channels, c.temporal_patch_size,
                                               c.patch_size, c.patch_size))

    def forward(self, pixels: Tensor) -> Tensor:
        return F.linear(pixels, self.weight.flatten(1))


class Rotary2D(nn.Module):
    """cos, sin [N, head_dim] for patches at (row, column): the first head_dim/4 frequencies turn with
    the row, the next head_dim/4 with the column, and the rotated half repeats both."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.theta, self.half = c.rope_theta, c.head_dim // 2

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.half, 2, dtype=torch.float32,
                                                      device=positions.device) / self.half)
        angles = (positions.float()[:, :, None] * inv_freq).flatten(1)  # [N, (row freqs, column freqs)]
        angles = torch.cat([angles, angles], dim=1)
        return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, heads, head_dim] turned by the angles (in float32), back in x's dtype."""
    y = x.float()
    first, second = y.chunk(2, dim=-1)
    turned = torch.cat([-second, first], dim=-1)
    return (y * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention within runs of the sequence (windows or frames), one SDPA over the runs
    padded to one width."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.heads = c.num_heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: Tensor, rotary: tuple[Tensor, Tensor], runs: Segments) -> Tensor:
        n, width = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = rotate(q, *rotary), rotate(k, *rotary)

        def batched(t: Tensor) -> Tensor:  # [N, heads, d] → [runs, heads, width, d]
            padded = t.new_zeros(runs.runs * runs.width, *t.shape[1:]).index_copy_(0, runs.slots, t)
            return padded.view(runs.runs, runs.width, *t.shape[1:]).transpose(1, 2)

        mask = None if runs.mask is None else runs.mask[:, None, None, :]
        y = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), attn_mask=mask)
        y = y.transpose(1, 2).reshape(runs.runs * runs.width, width)[runs.slots]
        return self.proj(y)


class Mlp(nn.Module):
    """SwiGLU with biases: down(act(gate(x)) * up(x))."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.act = ACTIVATIONS[c.hidden_act]
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """A pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(c.hidden_size)
        self.attn = Attention(c)
        self.norm2 = RMSNorm(c.hidden_size)
        self.mlp = Mlp(c)

    def forward(self, x: Tensor, rotary: tuple[Tensor, Tensor], runs: Segments) -> Tensor:
        x = x + self.attn(self.norm1(x), rotary, runs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm each patch, join a cell's m² consecutive patches, then Linear → GELU → Linear."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        joined = c.hidden_size * c.spatial_merge_size ** 2
        self.norm = RMSNorm(c.hidden_size)
        self.fc1 = nn.Linear(joined, joined)
        self.fc2 = nn.Linear(joined, c.out_hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x).view(-1, self.fc1.in_features))))


class QwenVLVision(nn.Module):
    """Patches [N, patch_dim] of one grid (t, h, w) or several (concatenated in the same order) →
    LLM embeddings [N / m², out_hidden_size] in the processor's token order."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.rotary = Rotary2D(c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)

    def forward(self, pixels: Tensor, grid: Grid | list[Grid] | Tensor) -> Tensor:
        c, m2 = self.config, self.config.spatial_merge_size ** 2
        grids = [tuple(g) for g in torch.as_tensor(grid).view(-1, 3).tolist()]
        expected = sum(t * h * w for t, h, w in grids)
        if pixels.shape != (expected, c.patch_dim):
            raise ValueError(f"pixels {tuple(pixels.shape)} do not fit grids {grids}: expected ({expected}, {c.patch_dim})")
        weight = self.patch_embed.weight
        plan = layout(grids, c, weight.device)
        x = self.patch_embed(pixels.to(weight.device, weight.dtype))
        x = x.view(-1, m2, x.shape[-1])[plan.order].flatten(0, 1)
        rotary = self.rotary(plan.positions)
        for i, block in enumerate(self.blocks):
            x = block(x, rotary, plan.frames if i in c.fullatt_block_indexes else plan.windows)
        return self.merger(x)[plan.inverse]
