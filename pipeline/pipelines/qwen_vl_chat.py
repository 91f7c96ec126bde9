"""Qwen2.5-VL image chat: the picture resized as its processor resizes it (dynamic resolution within
`min_pixels`/`max_pixels`, `pipeline.qwen_vl.preprocess`), encoded by the window-attention ViT and its
patch merger into one run of `<|image_pad|>` positions on an M-RoPE grid; the decoder is Qwen2 on our
engine (`vlm_chat` does the rest).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import torch

from pipeline.llm.language_model import LanguageModel
from pipeline.llm.text.prompt import CHATML_STOP_STRINGS
from pipeline.llm.text.tokenizer import load_tokenizer
from pipeline.pipelines.vlm_chat import (DecoderEngine, EncodedImage, VLMChatPipeline, VLMFormat, language_model,
                                         load_device)
from pipeline.qwen_vl.preprocess import PreprocessConfig, preprocess
from pipeline.qwen_vl.prompt import IMAGE_PAD, TURN_END, image_prompt, rope_positions
from pipeline.qwen_vl.text import load_text_decoder
from pipeline.qwen_vl.vision import QwenVLVision
from pipeline.qwen_vl.weights import load_vision

# The most positions a picture takes in our prompts (the checkpoint allows 16,384: 3,584² pixels). At
# 1,280 a photo keeps about 1,000² pixels, and a conversation about it fits a 4,096-token context.
MAX_IMAGE_TOKENS = 1280


class QwenVLChatPipeline(VLMChatPipeline):
    def __init__(self, vision: QwenVLVision, images: PreprocessConfig, llm: LanguageModel, is_demo: bool = False):
        super().__init__(llm, "Qwen2.5-VL", vision.config.out_hidden_size, is_demo)
        self.vision, self.images = vision, images

    @classmethod
    def load(cls, folder: Path, model_id: str, device: str, dtype: torch.dtype, context: int,
             max_batch: int, quant: str = "none", engine_of: DecoderEngine | None = None) -> QwenVLChatPipeline:
        """A Qwen2.5-VL folder as the hub ships it (or transformers writes it) on our engine, pictures
        capped at `MAX_IMAGE_TOKENS` positions."""
        llm = language_model(load_text_decoder(folder, dtype, load_device(device, quant)), load_tokenizer(folder),
                             model_id, device, context, max_batch, quant, engine_of)
        images = PreprocessConfig.from_folder(folder)
        cap = MAX_IMAGE_TOKENS * images.factor ** 2
        images = dataclasses.replace(images, max_pixels=min(images.max_pixels, cap),
                                     min_pixels=min(images.min_pixels, cap))
        return cls(load_vision(folder, device, dtype), images, llm)

    def release_vision(self) -> None:
        self.vision = None

    def read(self, image: np.ndarray) -> EncodedImage:
        """One slot of merged patches, row by row, and the grid M-RoPE places them on."""
        patches = preprocess(image, self.images)
        embeds = self.vision(patches.pixels, patches.grid)
        m = self.images.merge_size
        t, h, w = patches.grid
        grid = (t, h // m, w // m)
        return EncodedImage(image_prompt(self.llm.tokenizer, embeds.shape[0]), (embeds,),
                            functools.partial(rope_positions, grids=[grid]))

    def format(self, image: EncodedImage) -> VLMFormat:
        return VLMFormat(self.llm.tokenizer, image, IMAGE_PAD, TURN_END, CHATML_STOP_STRINGS)
