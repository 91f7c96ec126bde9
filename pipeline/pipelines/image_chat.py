"""ImageChatPipeline: MiniGPT-4 — talk about one image over several turns, streamed.

The image is encoded once per conversation (its 32 query embeddings cached by content) and fills
the prompt's image slot where the template puts `<ImageHere>`; generation is the chat tool's loop,
over the same kind of LLM engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from PIL import Image

from pipeline.errors import UserError
from pipeline.images import content_key
from pipeline.llm.engine.seam import ChatEvent
from pipeline.llm.language_model import LanguageModel
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.text.structure import Structure
from pipeline.minigpt4.engine import VisionEncoder
from pipeline.minigpt4.template import MiniGPT4Format
from pipeline.minigpt4.vision import CLIP_MEAN, CLIP_STD
from pipeline.pipelines.picture_cache import PictureCache


class ImageChatPipeline:
    model_id = "minigpt4"  # as API requests name image chat

    def __init__(self, encoder: VisionEncoder, llm: LanguageModel, template: str = "vicuna_v0",
                 is_demo: bool = False, owns_llm: bool = True):
        """`owns_llm` False: the LLM is the chat tool's (the same weights), and stays when this closes."""
        width = llm.engine.hidden_size
        if encoder.config.llm_width != width:
            raise UserError(f"the MiniGPT-4 projection outputs {encoder.config.llm_width} features but the LLM "
                            f"is {width} wide: the checkpoint is for another LLM")
        self.encoder = encoder
        self.llm = llm
        self.owns_llm = owns_llm
        self.format = MiniGPT4Format(llm.tokenizer, template, encoder.config.num_query_tokens)
        self.is_demo = is_demo
        self.pictures: PictureCache[torch.Tensor] = PictureCache()
        self.title = f"MiniGPT-4 over {llm.model_id}"
        self.description = f"MiniGPT-4 ({template}; vision: {encoder.name}) over {llm.description}"

    @property
    def encoder_runs(self) -> int:
        return self.pictures.runs

    def close(self) -> None:
        """Free the vision engine, the cached image embeddings and (when it is ours) the LLM."""
        self.pictures.clear()
        self.encoder = None
        if self.owns_llm:
            self.llm.close()

    def held_bytes(self) -> int:
        """Device memory in the cached image embeddings: it counts in the memory budget."""
        return sum(t.nbytes for t in list(self.pictures.items.values()))  # no lock: an encode holds it

    def preprocess(self, image: np.ndarray) -> torch.Tensor:
        """BLIP-2's evaluation transform: bicubic resize to the square input, CLIP mean/std."""
        size = self.encoder.config.img_size
        resized = np.asarray(Image.fromarray(image).resize((size, size), Image.BICUBIC), dtype=np.float32) / 255
        x = (torch.from_numpy(resized) - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
        return x.permute(2, 0, 1)[None]

    def image_key(self, image: np.ndarray) -> str:
        return content_key(image)

    def encode_image(self, image: np.ndarray) -> torch.Tensor:
        """The image's [num_query, llm_width] prompt embeddings, computed once per distinct image."""
        return self._encode(self.image_key(image), image)

    @torch.inference_mode()
    def _encode(self, key: str, image: np.ndarray) -> torch.Tensor:
        return self.pictures.get(key, lambda: self.encoder.encode(self.preprocess(image)))

    def stream(self, image: np.ndarray | None, messages: Sequence[dict], params: SamplingParams,
               cancel: threading.Event | None = None, session: str | None = None,
               structure: Structure = Structure()) -> Iterator[ChatEvent]:
        """Reply to the last user message about `image`, streamed; see `LanguageModel.reply`."""
        if image is None:
            raise UserError("upload an image first: image chat talks about one picture")
        key = self.image_key(image)
        embeds = self._encode(key, image)

        def fill(prompt: Prompt) -> Prompt:
            return prompt.fill(embeds, key)

        return self.llm.chat(messages, params, cancel, session, structure, self.format, fill)
