"""A tokenizer and an LLM engine: the reply loop that text chat and image chat share.

`reply` yields `ChatEvent`s rather than bare strings so that notices (turns dropped from the
context, a cut message) and the final statistics travel with the text to the UI and the API. It
works the same over every engine: it fits the prompt, submits it, and turns token ids into
UTF-8-safe text, cancelling the request when a stop string appears, when the caller's cancel flag
is set, or when the caller stops listening (a closed tab, a dropped API client).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

from pipeline.llm.engine import GenerationStats, LLMEngine, Prompt
from pipeline.llm.prompt import PromptFormat, chat_format, fit_prompt
from pipeline.llm.sampling import SamplingParams
from pipeline.llm.streaming import TextStream
from pipeline.llm.tokenizer import Tokenizer


@dataclasses.dataclass
class ChatEvent:
    text: str = ""
    notice: str | None = None
    stats: GenerationStats | None = None  # set on the last event only


class LanguageModel:
    def __init__(self, tokenizer: Tokenizer, engine: LLMEngine, model_id: str, description: str):
        self.tokenizer, self.engine, self.model_id = tokenizer, engine, model_id
        self.description = description

    def close(self) -> None:
        self.engine.close()

    @property
    def context(self) -> int:
        return self.engine.context

    @functools.cached_property
    def format(self) -> PromptFormat:
        """The model's own chat format: its checkpoint's chat template, else ChatML."""
        return chat_format(self.tokenizer)

    def check_chat(self) -> None:
        """Raise `UserError` now, at load, if this model has no chat format (a base LLaMA)."""
        self.format

    def status(self) -> dict:
        """What the engine is doing now (for `/engine_status`)."""
        return self.engine.status()

    def chat(self, messages: Sequence[dict], params: SamplingParams, cancel: threading.Event | None = None,
             session: str | None = None) -> Iterator[ChatEvent]:
        """Reply to `messages` in the model's own chat format; see `reply`."""
        return self.reply(self.format, messages, params, cancel, session)

    def reply(self, fmt: PromptFormat, messages: Sequence[dict], params: SamplingParams,
              cancel: threading.Event | None = None, session: str | None = None,
              fill: Callable[[Prompt], Prompt] | None = None) -> Iterator[ChatEvent]:
        """Reply to `messages` (the last one the user's) in prompt format `fmt`, a few characters at a time.

        `fill` completes the prompt's embedding slots (image chat's image); `session` names the
        conversation so the engine can reuse its earlier turns. Raises `UserError` for bad input or
        out-of-memory; a set `cancel` ends the reply early, keeping what was said so far.
        """
        params = params.validated()
        reply_room = min(params.max_new_tokens, self.context // 2)
        prompt, notices = fit_prompt(fmt, messages, self.context - reply_room)
        for notice in notices:
            yield ChatEvent(notice=notice)
        if fill is not None:
            prompt = fill(prompt)
        stream = self.engine.submit(prompt, params, fmt.stop_ids, session=session, cancel=cancel)
        text = TextStream(self.tokenizer, (*fmt.stop_strings, *params.stop))
        started = False
        try:
            for token_id in stream:
                piece = text.push(token_id)
                if not started:  # SentencePiece replies start with the space of "▁word"
                    piece = piece.lstrip()
                    started = bool(piece)
                if piece:
                    yield ChatEvent(text=piece)
                if text.stopped:
                    stream.cancel("stop")
                    break
        finally:  # the caller stopped listening (GeneratorExit here): the engine drops the request
            if not stream.cancelled:
                stream.cancel()
        stats = stream.wait()
        tail = text.finish()
        full = "The reply reached the end of the model's context window." if stats.finish_reason == "context" else None
        yield ChatEvent(text=tail if started else tail.lstrip(), notice=full, stats=stats)
