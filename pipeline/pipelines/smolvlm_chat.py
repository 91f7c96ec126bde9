"""SmolVLM image chat: talk about one picture over several turns, streamed, on our engine.

The picture is cut into tiles as SmolVLM's processor cuts them (`pipeline.smolvlm.preprocess`), each tile
encoded once per picture (SigLIP + the pixel-shuffle connector, cached by content) into its own run of
`<image>` positions; the conversation is written with the checkpoint's own chat template, the picture riding
with the earliest user turn still in the prompt, and the decoder is the LLaMA family the chat tool serves.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import UserError
from pipeline.images import content_key
from pipeline.llm.engine.sampling import SamplingParams
from pipeline.llm.engine.seam import ChatEvent
from pipeline.llm.language_model import LanguageModel
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.text.structure import Structure
from pipeline.llm.engine.torch_engine import TorchLLMEngine
from pipeline.llm.text.tokenizer import Tokenizer, load_tokenizer
from pipeline.smolvlm.preprocess import PreprocessConfig, preprocess
from pipeline.smolvlm.prompt import IMAGE, ImagePrompt, expand_images, image_ids
from pipeline.smolvlm.text import load_text_decoder
from pipeline.smolvlm.vision import SmolVLMVision
from pipeline.smolvlm.weights import load_vision

IMAGE_CACHE = 16  # pictures whose tile embeddings are kept
END_OF_UTTERANCE = "<end_of_utterance>"


class SmolVLMFormat:
    """A `PromptFormat`: the checkpoint's chat template with the picture's `<image>` expanded into one slot
    per tile, as its processor expands it."""

    def __init__(self, tokenizer: Tokenizer, image: ImagePrompt):
        self.tokenizer, self.image = tokenizer, image
        self.image_id = tokenizer.special_id(IMAGE)
        end = tokenizer.special_id(END_OF_UTTERANCE)
        if self.image_id is None or end is None:
            raise UserError(f"the tokenizer has no {IMAGE} or {END_OF_UTTERANCE} token: it is not SmolVLM's")
        self.stop_ids = tokenizer.eos_ids | {end}
        self.stop_strings = (END_OF_UTTERANCE,)
        self.tool_calls = None  # its template writes no tools

    def render(self, messages: Sequence[dict], tools: Sequence[dict] = ()) -> Prompt:
        turns, placed = [], False
        for m in messages:
            content = [{"type": "text", "text": m["content"] or ""}]
            if m["role"] == "user" and not placed:
                content, placed = [{"type": "image"}, *content], True
            turns.append({"role": m["role"], "content": content})
        ids = self.tokenizer.render_chat_template(turns)
        expanded = expand_images(ids, self.image_id, [self.image] if placed else [])
        return Prompt(expanded.ids, expanded.slots)


class SmolVLMChatPipeline:
    def __init__(self, vision: SmolVLMVision, images: PreprocessConfig, llm: LanguageModel, is_demo: bool = False):
        width = llm.engine.hidden_size
        if vision.config.text_width != width:
            raise UserError(f"the SmolVLM connector outputs {vision.config.text_width} features but the LLM is "
                            f"{width} wide: the vision weights are for another model")
        self.vision, self.images, self.llm, self.is_demo = vision, images, llm, is_demo
        self._cache: collections.OrderedDict[str, tuple[ImagePrompt, torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.encoder_runs = 0
        self.description = f"SmolVLM over {llm.description}"

    @classmethod
    def load(cls, folder: Path, model_id: str, device: str, dtype: torch.dtype, context: int,
             max_batch: int) -> SmolVLMChatPipeline:
        """A SmolVLM folder as transformers writes it (its vision side, decoder, tokenizer and processor
        files) on our engine."""
        decoder, tokenizer = load_text_decoder(folder, dtype, device), load_tokenizer(folder)
        engine = TorchLLMEngine(decoder, min(context, decoder.config.max_position_embeddings),
                                tokenizer.vocab_size, max_batch=max_batch)  # (the logits' padding never drawn)
        llm = LanguageModel(tokenizer, engine, model_id, f"{model_id} · {engine.description} · {device}")
        return cls(load_vision(folder, device, dtype), PreprocessConfig.from_folder(folder), llm)

    def close(self) -> None:
        with self._lock:
            self.vision = None
            self._cache.clear()
        self.llm.close()

    def held_bytes(self) -> int:
        return sum(t.nbytes for _, t in list(self._cache.values()))

    @torch.inference_mode()
    def encode_image(self, image: np.ndarray) -> tuple[str, ImagePrompt, torch.Tensor]:
        """(content key, its prompt expansion, its tiles' embeddings [tiles, tokens, width]), once per picture."""
        key = content_key(image)
        with self._lock:
            if key not in self._cache:
                tiles = preprocess(image, self.images)
                try:
                    features = self.vision(tiles.pixels, tiles.pixel_mask)
                except torch.OutOfMemoryError:
                    raise UserError("the GPU ran out of memory encoding this image") from None
                prompt = image_ids(self.llm.tokenizer, tiles.rows, tiles.cols, self.vision.config.tokens_per_image)
                self._cache[key] = (prompt, features)
                self.encoder_runs += 1
                while len(self._cache) > IMAGE_CACHE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return key, *self._cache[key]

    def stream(self, image: np.ndarray | None, messages: Sequence[dict], params: SamplingParams,
               cancel: threading.Event | None = None, session: str | None = None,
               structure: Structure = Structure()) -> Iterator[ChatEvent]:
        """Reply to the last user message about `image`, streamed; see `LanguageModel.chat`."""
        if image is None:
            raise UserError("upload an image first: image chat talks about one picture")
        key, expansion, features = self.encode_image(image)

        def fill(prompt: Prompt) -> Prompt:
            tiles = len(features)
            return dataclasses.replace(prompt, embeds=tuple(features) * (len(prompt.slots) // tiles),
                                       keys=tuple(f"{key}/{i}" for i in range(tiles)) * (len(prompt.slots) // tiles))

        return self.llm.chat(messages, params, cancel, session, structure, SmolVLMFormat(self.llm.tokenizer, expansion),
                             fill)
