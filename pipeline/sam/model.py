"""SAM = image encoder + prompt encoder + mask decoder, with the official checkpoints' layout.

Variants: the three published ViT sizes, MobileSAM (SAM's prompt encoder and mask decoder behind a
TinyViT image encoder, `mobile_sam.pt`), and a tiny demo configuration (random weights, same `.pth`
layout, same 1024-px input and 256×256 low-res masks) so the Segment tab runs anywhere.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor, nn

from pipeline.errors import UserError
from pipeline.sam.image_encoder import ImageEncoderViT
from pipeline.sam.mask_decoder import MaskDecoder, TwoWayTransformer, select_masks
from pipeline.sam.prompt_encoder import PromptEncoder
from pipeline.sam.tiny_vit import TinyViT, TinyViTConfig, drop_unused_keys
from pipeline.weights_io import read_weight_file

PIXEL_MEAN = (123.675, 116.28, 103.53)
PIXEL_STD = (58.395, 57.12, 57.375)


@dataclasses.dataclass(frozen=True)
class SamConfig:
    """With `tiny_vit` set the image encoder is TinyViT (MobileSAM), and the `encoder_*` fields only describe
    it: its last stage's width and heads, its blocks in all stages, no global attention."""

    encoder_embed_dim: int
    encoder_depth: int
    encoder_num_heads: int
    encoder_global_attn_indexes: tuple[int, ...]
    img_size: int = 1024
    patch_size: int = 16
    window_size: int = 14
    prompt_embed_dim: int = 256
    decoder_depth: int = 2
    decoder_mlp_dim: int = 2048
    decoder_num_heads: int = 8
    mask_in_chans: int = 16
    tiny_vit: TinyViTConfig | None = None

    @property
    def embedding_size(self) -> int:
        return self.img_size // self.patch_size


VARIANTS = {
    "vit_h": SamConfig(1280, 32, 16, (7, 15, 23, 31)),
    "vit_l": SamConfig(1024, 24, 16, (5, 11, 17, 23)),
    "vit_b": SamConfig(768, 12, 12, (2, 5, 8, 11)),
    "mobile_sam": SamConfig(320, 12, 10, (), tiny_vit=TinyViTConfig()),
    "demo": SamConfig(32, 2, 2, (1,), prompt_embed_dim=32, decoder_mlp_dim=64, decoder_num_heads=2),
}


class Sam(nn.Module):
    def __init__(self, config: SamConfig):
        super().__init__()
        self.config = config
        c = config
        self.image_encoder: ImageEncoderViT | TinyViT
        if c.tiny_vit is not None:
            self.image_encoder = TinyViT(c.tiny_vit, c.img_size, c.prompt_embed_dim)
        else:
            self.image_encoder = ImageEncoderViT(c.img_size, c.patch_size, c.encoder_embed_dim, c.encoder_depth,
                                                 c.encoder_num_heads, c.encoder_global_attn_indexes, c.window_size,
                                                 c.prompt_embed_dim)
        grid = (c.embedding_size, c.embedding_size)
        self.prompt_encoder = PromptEncoder(c.prompt_embed_dim, grid, (c.img_size, c.img_size), c.mask_in_chans)
        self.mask_decoder = MaskDecoder(
            c.prompt_embed_dim,
            TwoWayTransformer(c.decoder_depth, c.prompt_embed_dim, c.decoder_num_heads, c.decoder_mlp_dim),
            iou_head_hidden_dim=c.prompt_embed_dim)
        self.register_buffer("pixel_mean", torch.tensor(PIXEL_MEAN).view(-1, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(PIXEL_STD).view(-1, 1, 1), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.pixel_mean.device

    def decode(self, embedding: Tensor, points: tuple[Tensor, Tensor] | None, box: Tensor | None,
               mask_input: Tensor | None, multimask_output: bool) -> tuple[Tensor, Tensor]:
        """Low-res mask logits [1, M, 4h, 4w] and IoU predictions [1, M] for prompts in model-input pixels."""
        sparse, dense = self.prompt_encoder(points, box, mask_input)
        masks, iou = self.mask_decoder(embedding, self.prompt_encoder.get_dense_pe(), sparse, dense)
        return select_masks(masks, iou, multimask_output)


def tiny_vit_variant(state: dict[str, Tensor]) -> SamConfig:
    """The MobileSAM configuration whose stage widths and depths `state`'s TinyViT tensors have."""
    prefix = "image_encoder.layers."
    try:
        stages = 1 + max(int(k.split(".")[2]) for k in state if k.startswith(prefix))
        depths = tuple(1 + max(int(k.split(".")[4]) for k in state if k.startswith(f"{prefix}{i}.blocks."))
                       for i in range(stages))
        widths = (state["image_encoder.patch_embed.seq.2.c.weight"].shape[0],
                  *(state[f"{prefix}{i}.downsample.conv1.c.weight"].shape[0] for i in range(stages - 1)))
    except (KeyError, ValueError, IndexError):
        raise UserError("this file is not a MobileSAM checkpoint (its TinyViT stages are incomplete)") from None
    for config in VARIANTS.values():
        if config.tiny_vit is not None and (config.tiny_vit.embed_dims, config.tiny_vit.depths) == (widths, depths):
            return config
    raise UserError(f"unknown TinyViT (MobileSAM) variant: stage widths {widths}, depths {depths}")


def variant_of(state: dict[str, Tensor]) -> SamConfig:
    """Which configuration a checkpoint's tensors describe: TinyViT by its convolutional stem, ViTs by
    width and depth."""
    if "image_encoder.patch_embed.seq.0.c.weight" in state:
        return tiny_vit_variant(state)
    try:
        width = state["image_encoder.patch_embed.proj.weight"].shape[0]
        depth = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("image_encoder.blocks."))
    except (KeyError, ValueError):
        raise UserError("this file is not a SAM checkpoint (no image_encoder.blocks.* tensors)") from None
    for config in VARIANTS.values():
        if config.tiny_vit is None and (config.encoder_embed_dim, config.encoder_depth) == (width, depth):
            return config
    raise UserError(f"unknown SAM variant: encoder width {width}, depth {depth}")


def load_sam(path: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Sam:
    """Load an official-layout SAM `.pth` or MobileSAM `mobile_sam.pt` (tensors only: `weights_only=True`).
    Strict: but for the keys `tiny_vit.CHECKPOINT_KEYS_NOT_USED` lists, every tensor must be one we use."""
    state = read_weight_file(path, "SAM checkpoint")
    with torch.device("meta"):
        model = Sam(variant_of(state))
    if isinstance(model.image_encoder, TinyViT):
        state = drop_unused_keys(state, model.image_encoder)
    model.load_state_dict(state, strict=True, assign=True)
    model.register_buffer("pixel_mean", torch.tensor(PIXEL_MEAN).view(-1, 1, 1), persistent=False)
    model.register_buffer("pixel_std", torch.tensor(PIXEL_STD).view(-1, 1, 1), persistent=False)
    model.image_encoder.to(dtype)
    return model.to(device).eval()
