"""SmolVLM image chat: the picture cut into tiles as SmolVLM's processor cuts them
(`pipeline.smolvlm.preprocess`), each tile encoded (SigLIP + the pixel-shuffle connector) into its own run
of `<image>` positions; the decoder is the LLaMA family the chat tool serves (`vlm_chat` does the rest).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from pipeline.llm.language_model import LanguageModel
from pipeline.llm.text.tokenizer import load_tokenizer
from pipeline.pipelines.vlm_chat import (DecoderEngine, EncodedImage, VLMChatPipeline, VLMFormat, language_model,
                                         load_device)
from pipeline.smolvlm.preprocess import PreprocessConfig, preprocess
from pipeline.smolvlm.prompt import IMAGE, image_ids
from pipeline.smolvlm.text import load_text_decoder
from pipeline.smolvlm.vision import SmolVLMVision
from pipeline.smolvlm.weights import load_vision

END_OF_UTTERANCE = "<end_of_utterance>"
# On a CPU a picture is read at up to 2 × 2 tiles (+ the global view: 5 tiles, 1,024 px for 512-px tiles) rather
# than the checkpoint's 4 × 4 (17 tiles): SigLIP over 13-17 tiles kept the first token ~20 s away on a laptop.
CPU_TILES_PER_SIDE = 2


class SmolVLMChatPipeline(VLMChatPipeline):
    def __init__(self, vision: SmolVLMVision, images: PreprocessConfig, llm: LanguageModel, is_demo: bool = False):
        super().__init__(llm, "SmolVLM", vision.config.text_width, is_demo)
        self.vision, self.images = vision, images

    @classmethod
    def load(cls, folder: Path, model_id: str, device: str, dtype: torch.dtype, context: int,
             max_batch: int, quant: str = "none", engine_of: DecoderEngine | None = None) -> SmolVLMChatPipeline:
        """A SmolVLM folder as transformers writes it (its vision side, decoder, tokenizer and processor
        files) on our engine; on a CPU, pictures at up to `CPU_TILES_PER_SIDE` tiles a side."""
        llm = language_model(load_text_decoder(folder, dtype, load_device(device, quant)), load_tokenizer(folder),
                             model_id, device, context, max_batch, quant, engine_of)
        images = PreprocessConfig.from_folder(folder)
        if device == "cpu":
            images = dataclasses.replace(images, longest_edge=min(images.longest_edge, CPU_TILES_PER_SIDE * images.tile))
        return cls(load_vision(folder, device, dtype), images, llm)

    def release_vision(self) -> None:
        self.vision = None

    def read(self, image: np.ndarray) -> EncodedImage:
        """One slot per tile (the grid's, then the global view), each its tile's embeddings."""
        tiles = preprocess(image, self.images)
        features = self.vision(tiles.pixels, tiles.pixel_mask)
        prompt = image_ids(self.llm.tokenizer, tiles.rows, tiles.cols, self.vision.config.tokens_per_image)
        return EncodedImage(prompt, tuple(features))

    def format(self, image: EncodedImage) -> VLMFormat:
        return VLMFormat(self.llm.tokenizer, image, IMAGE, END_OF_UTTERANCE, (END_OF_UTTERANCE,))
