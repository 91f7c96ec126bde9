"""ChatPipeline: messages in, streamed text out, on the torch backend.

`stream` yields `ChatEvent`s rather than bare strings so that notices (turns dropped from the
context, a cut message) and the final statistics travel with the text to the UI and the API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.llm.checkpoint import load_decoder
from pipeline.llm.generate import GenerationStats, Generator
from pipeline.llm.model import Decoder
from pipeline.llm.prompt import PromptFormat, fit_prompt
from pipeline.llm.sampling import SamplingParams
from pipeline.llm.streaming import TextStream
from pipeline.llm.tokenizer import load_tokenizer


@dataclasses.dataclass
class ChatEvent:
    text: str = ""
    notice: str | None = None
    stats: GenerationStats | None = None  # set on the last event only


class LanguageModel:
    """A decoder, its tokenizer and its generation loop: what text and image chat share."""

    def __init__(self, model_dir: Path, model_id: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_context: int = 8192):
        self.model_id = model_id
        self.tokenizer = load_tokenizer(model_dir)
        model = load_decoder(model_dir, dtype=dtype, device=device)
        self.context = min(max_context, model.config.max_position_embeddings)
        self.generator = Generator(model, self.context)
        self.description = (f"{model_id} ({model.config.family}, "
                            f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params) · torch · "
                            f"{device} · {str(dtype).removeprefix('torch.')} · context {self.context}")

    @property
    def model(self) -> Decoder:
        return self.generator.model

    def reply(self, fmt, messages: Sequence[dict], params: SamplingParams, cancel: threading.Event | None = None,
              embed: Callable[[list[int]], torch.Tensor] | None = None) -> Iterator[ChatEvent]:
        """Reply to `messages` (the last one the user's) in prompt format `fmt`, a few characters at a time.

        `embed` turns the prompt ids into input embeddings (image chat splices image features in);
        without it the ids go in as they are. Raises `UserError` for bad input or out-of-memory; a
        set `cancel` ends the reply early, keeping what was said so far.
        """
        params = params.validated()
        reply_room = min(params.max_new_tokens, self.context // 2)
        ids, notices = fit_prompt(fmt, messages, self.context - reply_room)
        for notice in notices:
            yield ChatEvent(notice=notice)
        text = TextStream(self.tokenizer, fmt.stop_strings)
        stats = GenerationStats()
        prompt = dict(prefix_embeds=embed(ids)) if embed is not None else dict(prompt_ids=ids)
        tokens = self.generator.stream(params, fmt.stop_ids, cancel=cancel, stats=stats,
                                       vocab_size=self.tokenizer.vocab_size, **prompt)
        started = False
        try:
            with contextlib.closing(tokens):  # releases the model at once if we stop early
                for token_id in tokens:
                    piece = text.push(token_id)
                    if not started:  # SentencePiece replies start with the space of "▁word"
                        piece = piece.lstrip()
                        started = bool(piece)
                    if piece:
                        yield ChatEvent(text=piece)
                    if text.stopped:
                        stats.finish_reason = "stop"
                        break
        except torch.OutOfMemoryError:
            raise UserError("the GPU ran out of memory for this reply: shorten the conversation "
                            "or lower max new tokens") from None
        tail = text.finish()
        full = "The reply reached the end of the model's context window." if stats.finish_reason == "context" else None
        yield ChatEvent(text=tail if started else tail.lstrip(), notice=full, stats=stats)


class ChatPipeline:
    def __init__(self, model_dir: Path, model_id: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_context: int = 8192, is_demo: bool = False):
        self.llm = LanguageModel(model_dir, model_id, device, dtype, max_context)
        self.format = PromptFormat(self.llm.tokenizer)
        self.is_demo = is_demo
        self.description = self.llm.description

    def stream(self, messages: Sequence[dict], params: SamplingParams,
               cancel: threading.Event | None = None) -> Iterator[ChatEvent]:
        """Reply to `messages` (the last one the user's), streamed; see `LanguageModel.reply`."""
        return self.llm.reply(self.format, messages, params, cancel)
