"""ImageChatPipeline: MiniGPT-4 — talk about one image over several turns, streamed.

The image is encoded once per conversation (its 32 query embeddings cached by content) and spliced
into the prompt embeddings where the template puts `<ImageHere>`; generation is the chat tool's
loop fed with embeddings instead of ids.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pipeline.chat import ChatEvent, LanguageModel
from pipeline.cuda_graphs import CapturedCall
from pipeline.errors import UserError
from pipeline.llm.sampling import SamplingParams
from pipeline.minigpt4.template import IMAGE_TOKEN, MiniGPT4Format
from pipeline.minigpt4.vision import CLIP_MEAN, CLIP_STD, MiniGPT4Vision

IMAGE_CACHE = 16  # conversations' image embeddings kept (32 × 4096 floats each for Vicuna-7B)


class ImageChatPipeline:
    def __init__(self, vision: MiniGPT4Vision, llm_dir: Path, model_id: str, template: str = "vicuna_v0",
                 device: str = "cpu", dtype: torch.dtype = torch.float32, max_context: int = 2048,
                 is_demo: bool = False):
        self.llm = LanguageModel(llm_dir, model_id, device, dtype, max_context)
        if vision.config.llm_width != self.llm.model.config.hidden_size:
            raise UserError(f"the MiniGPT-4 projection outputs {vision.config.llm_width} features but the LLM "
                            f"is {self.llm.model.config.hidden_size} wide: the checkpoint is for another LLM")
        self.vision = vision
        self.format = MiniGPT4Format(self.llm.tokenizer, template, vision.config.num_query_tokens)
        self.is_demo = is_demo
        self._cache: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.encoder_runs = 0
        self._graphed_vision: CapturedCall | None = None
        self.description = f"MiniGPT-4 ({template}) over {self.llm.description}"

    def preprocess(self, image: np.ndarray) -> torch.Tensor:
        """BLIP-2's evaluation transform: bicubic resize to the square input, CLIP mean/std."""
        size = self.vision.config.img_size
        resized = np.asarray(Image.fromarray(image).resize((size, size), Image.BICUBIC), dtype=np.float32) / 255
        x = (torch.from_numpy(resized) - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
        return x.permute(2, 0, 1)[None]

    @torch.inference_mode()
    def encode_image(self, image: np.ndarray) -> torch.Tensor:
        """The image's [num_query, llm_width] prompt embeddings, computed once per distinct image."""
        key = hashlib.sha1(np.ascontiguousarray(image).data).hexdigest() + f"-{image.shape}"
        with self._lock:
            if key not in self._cache:
                param = next(self.vision.parameters())
                pixels = self.preprocess(image).to(param.device, param.dtype)
                try:
                    if param.device.type == "cuda":  # ~600 small kernels: replay them as one graph
                        self._graphed_vision = self._graphed_vision or CapturedCall(self.vision, pixels)
                        feats = self._graphed_vision(pixels)[0]
                    else:
                        feats = self.vision(pixels)[0]
                except torch.OutOfMemoryError:
                    raise UserError("the GPU ran out of memory encoding this image") from None
                self._cache[key] = feats.to(self.llm.model.embed.weight.dtype)
                self.encoder_runs += 1
                while len(self._cache) > IMAGE_CACHE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return self._cache[key]

    @torch.inference_mode()
    def splice(self, ids: list[int], image_embeds: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings [1, T, hidden]: token embeddings with the IMAGE_TOKEN run replaced."""
        start = ids.index(IMAGE_TOKEN)
        end = start + image_embeds.shape[0]
        if ids[start:end] != [IMAGE_TOKEN] * image_embeds.shape[0] or IMAGE_TOKEN in ids[end:]:
            raise ValueError("the prompt must hold exactly one run of image placeholders")
        embed = self.llm.model.embed
        device = embed.weight.device

        def tokens(part: list[int]) -> torch.Tensor:
            return embed(torch.tensor(part, dtype=torch.long, device=device))

        return torch.cat([tokens(ids[:start]), image_embeds.to(device), tokens(ids[end:])])[None]

    def stream(self, image: np.ndarray | None, messages: Sequence[dict], params: SamplingParams,
               cancel: threading.Event | None = None) -> Iterator[ChatEvent]:
        """Reply to the last user message about `image`, streamed; see `LanguageModel.reply`."""
        if image is None:
            raise UserError("upload an image first: image chat talks about one picture")
        image_embeds = self.encode_image(image)
        return self.llm.reply(self.format, messages, params, cancel, embed=lambda ids: self.splice(ids, image_embeds))
