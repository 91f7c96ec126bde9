"""Image chat with a vision-language model on our engine: one picture, several turns, streamed.

What SmolVLM and Qwen2.5-VL share lives here: the picture is encoded once (cached by content) into the
runs of image tokens its processor would write, the conversation is written with the checkpoint's own
chat template, the picture riding with the earliest user turn still in the prompt, and the decoder is a
text model the chat tool already serves. A model's subclass says how a picture becomes embeddings and
prompt ids (`read`) and which tokens mark images and turn ends (`format`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from pipeline.errors import UserError
from pipeline.images import content_key
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.engine.seam import ChatEvent
from pipeline.llm.engine.torch_engine import TorchLLMEngine
from pipeline.llm.language_model import LanguageModel
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.text.prompt import Prompt, expand_images
from pipeline.llm.text.structure import Structure
from pipeline.llm.text.tokenizer import Tokenizer
from pipeline.llm.weights.quant import kernel_unavailable, quantize_decoder, use_kernels
from pipeline.pipelines.picture_cache import PictureCache



@dataclasses.dataclass(frozen=True)
class EncodedImage:
    """A picture as its model reads it: the ids its one image token grows into, with `slots`, and each
    slot's embeddings [length, width] in order; `rope` gives a whole prompt's M-RoPE positions from its
    ids and this picture's slots (Qwen2.5-VL), None for plain positions."""

    expansion: Prompt
    embeds: tuple[Tensor, ...]
    rope: Callable[[Prompt], Tensor] | None = None


class VLMFormat:
    """A `PromptFormat`: the checkpoint's chat template with the picture's image token expanded as its
    processor expands it."""

    def __init__(self, tokenizer: Tokenizer, image: EncodedImage, image_token: str, end_token: str,
                 stop_strings: tuple[str, ...]):
        self.tokenizer, self.image = tokenizer, image
        self.image_id = tokenizer.special_id(image_token)
        end = tokenizer.special_id(end_token)
        if self.image_id is None or end is None:
            raise UserError(f"the tokenizer has no {image_token} or {end_token} token: it is not this model's")
        self.stop_ids = tokenizer.eos_ids | {end}
        self.stop_strings = stop_strings
        self.tool_calls = None  # their templates write no tools

    def render(self, messages: Sequence[dict], tools: Sequence[dict] = ()) -> Prompt:
        turns, placed = [], False
        for m in messages:
            content = [{"type": "text", "text": m["content"] or ""}]
            if m["role"] == "user" and not placed:
                content, placed = [{"type": "image"}, *content], True
            turns.append({"role": m["role"], "content": content})
        ids = self.tokenizer.render_chat_template(turns)
        expanded = expand_images(ids, self.image_id, [self.image.expansion] if placed else [])
        rope = self.image.rope(expanded) if placed and self.image.rope is not None else None
        return Prompt(expanded.ids, expanded.slots, rope=rope)


# A float decoder → the module that runs it and how (the studio's ONNX Runtime engine of 8-bit blocks, on the CPU)
DecoderEngine = Callable[[Decoder], tuple[torch.nn.Module, str]]


def language_model(decoder: Decoder, tokenizer: Tokenizer, model_id: str, device: str, context: int,
                   max_batch: int, quant: str = "none", engine_of: DecoderEngine | None = None) -> LanguageModel:
    """A VLM's decoder on our engine, as the chat tool runs text models; `quant` int8/int4: its block
    projections quantized now, from a decoder loaded on the CPU (`load_device`), onto `device` and the
    low-bit kernels where they run there; `engine_of`: run by the module it makes of the float decoder instead."""
    weights = str(decoder.norm.weight.dtype).removeprefix("torch.")
    if engine_of is not None:
        decoder, weights = engine_of(decoder)
    elif quant != "none":
        decoder = quantize_decoder(decoder, quant, device).to(device)
        why = kernel_unavailable(decoder)
        if why is None:
            use_kernels(decoder)
        weights = f"{quant} weights" + (" (dequantized per call)" if why else "")
    engine = TorchLLMEngine(decoder, min(context, decoder.config.max_position_embeddings), tokenizer.vocab_size,
                            max_batch=max_batch)  # (the logits' padding never drawn)
    return LanguageModel(tokenizer, engine, model_id, f"{model_id} · {weights} · {engine.description} · {device}")


def load_device(device: str, quant: str) -> str:
    """Where a VLM's float decoder loads: the CPU when it is quantized (never all its float weights on the GPU)."""
    return "cpu" if quant != "none" else device


class VLMChatPipeline:
    """Image chat over `llm`; a subclass reads pictures (`read`) and writes prompts (`format`)."""

    def __init__(self, llm: LanguageModel, name: str, width: int, is_demo: bool = False):
        """`width`: what the vision side gives the decoder per position (refused unless the decoder's own)."""
        if width != llm.engine.hidden_size:
            raise UserError(f"the {name} vision side outputs {width} features but the LLM is "
                            f"{llm.engine.hidden_size} wide: the vision weights are for another model")
        self.llm, self.description, self.is_demo = llm, f"{name} over {llm.description}", is_demo
        self.title = f"{name} over {llm.model_id}"
        self.model_id = llm.model_id  # as API requests name image chat
        self.pictures: PictureCache[EncodedImage] = PictureCache()

    def read(self, image: np.ndarray) -> EncodedImage:
        raise NotImplementedError

    def format(self, image: EncodedImage) -> VLMFormat:
        raise NotImplementedError

    def release_vision(self) -> None:
        """Drop the vision side's weights (on close)."""

    @property
    def encoder_runs(self) -> int:
        return self.pictures.runs

    def close(self) -> None:
        self.pictures.clear()
        self.release_vision()
        self.llm.close()

    def held_bytes(self) -> int:
        return sum(t.nbytes for image in list(self.pictures.items.values()) for t in image.embeds)

    @torch.inference_mode()
    def encode_image(self, image: np.ndarray) -> tuple[str, EncodedImage]:
        """(content key, the picture as the model reads it), encoded once per picture."""
        key = content_key(image)
        return key, self.pictures.get(key, lambda: self.read(image))

    def stream(self, image: np.ndarray | None, messages: Sequence[dict], params: SamplingParams,
               cancel: threading.Event | None = None, session: str | None = None,
               structure: Structure = Structure()) -> Iterator[ChatEvent]:
        """Reply to the last user message about `image`, streamed; see `LanguageModel.chat`."""
        if image is None:
            raise UserError("upload an image first: image chat talks about one picture")
        key, encoded = self.encode_image(image)
        count = len(encoded.embeds)

        def fill(prompt: Prompt) -> Prompt:
            times = len(prompt.slots) // count
            return dataclasses.replace(prompt, embeds=encoded.embeds * times,
                                       keys=tuple(f"{key}/{i}" for i in range(count)) * times)

        return self.llm.chat(messages, params, cancel, session, structure, self.format(encoded), fill)
