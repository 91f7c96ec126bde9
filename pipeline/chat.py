"""ChatPipeline: messages in, streamed text out, on the torch backend.

`stream` yields `ChatEvent`s rather than bare strings so that notices (turns dropped from the
context, a cut message) and the final statistics travel with the text to the UI and the API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.llm.checkpoint import load_decoder
from pipeline.llm.generate import GenerationStats, Generator
from pipeline.llm.prompt import PromptFormat, fit_prompt
from pipeline.llm.sampling import SamplingParams
from pipeline.llm.streaming import TextStream
from pipeline.llm.tokenizer import load_tokenizer


@dataclasses.dataclass
class ChatEvent:
    text: str = ""
    notice: str | None = None
    stats: GenerationStats | None = None  # set on the last event only


class ChatPipeline:
    def __init__(self, model_dir: Path, model_id: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_context: int = 8192, is_demo: bool = False):
        self.model_id = model_id
        self.is_demo = is_demo
        self.tokenizer = load_tokenizer(model_dir)
        self.format = PromptFormat(self.tokenizer)
        model = load_decoder(model_dir, dtype=dtype, device=device)
        self.context = min(max_context, model.config.max_position_embeddings)
        self.generator = Generator(model, self.context)
        self.description = (f"{model_id} ({model.config.family}, "
                            f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params) · torch · "
                            f"{device} · {str(dtype).removeprefix('torch.')} · context {self.context}")

    def stream(self, messages: Sequence[dict], params: SamplingParams,
               cancel: threading.Event | None = None) -> Iterator[ChatEvent]:
        """Reply to `messages` (the last one the user's), a few characters at a time.

        Raises `UserError` for bad input or out-of-memory; a set `cancel` ends the reply early,
        keeping what was said so far.
        """
        params = params.validated()
        reply_room = min(params.max_new_tokens, self.context // 2)
        ids, notices = fit_prompt(self.format, messages, self.context - reply_room)
        for notice in notices:
            yield ChatEvent(notice=notice)
        text = TextStream(self.tokenizer, self.format.stop_strings)
        stats = GenerationStats()
        tokens = self.generator.stream(params, self.format.stop_ids, prompt_ids=ids, cancel=cancel, stats=stats,
                                         vocab_size=self.tokenizer.vocab_size)
        try:
            with contextlib.closing(tokens):  # releases the model at once if we stop early
                for token_id in tokens:
                    piece = text.push(token_id)
                    if piece:
                        yield ChatEvent(text=piece)
                    if text.stopped:
                        stats.finish_reason = "stop"
                        break
        except torch.OutOfMemoryError:
            raise UserError("the GPU ran out of memory for this reply: shorten the conversation "
                            "or lower max new tokens") from None
        full = "The reply reached the end of the model's context window." if stats.finish_reason == "context" else None
        yield ChatEvent(text=text.finish(), notice=full, stats=stats)
