"""The LLM engine's contract: what pipelines hand an engine, what they get back, and the two protocols.

Pipelines hand an engine a `Prompt` (token ids, plus embeddings for marked slots: image chat's
query embeddings; defined in `text/prompt.py`, the layer below, where the prompt formats build it),
`SamplingParams`, stop ids and optionally a session name; they get back a `TokenStream` of token ids
that they iterate, and can cancel, from any thread. Everything above
this seam (prompt formats, context fitting, UTF-8-safe text) is the same for every backend.
Above that, a `ChatModel` (a local `LanguageModel` or a remote server) turns messages into
`ChatEvent`s. A leaf module: engines and models import it, never the reverse, so the seam's
types carry no implementation with them.
"""

from __future__ import annotations

import dataclasses
import enum
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.grammar import Grammar
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.text.structure import Structure
from pipeline.llm.text.tool_calls import ToolCall

if TYPE_CHECKING:  # annotations only: the contract imports no torch
    from torch import Tensor


class FinishReason(enum.StrEnum):
    """Why a reply ended. String-valued (a `str` itself): stored conversations and the API keep the words."""

    STOP = "stop"  # a stop id or stop string
    LENGTH = "length"  # max new tokens
    CONTEXT = "context"  # the context window is full
    CANCELLED = "cancelled"  # Stop, or the caller stopped listening
    ERROR = "error"


# How the status line tells people why a reply ended (`--verbose` shows the engine's word instead).
ENDED_IN_WORDS = {FinishReason.STOP: "complete", FinishReason.LENGTH: "cut at the token limit",
                  FinishReason.CONTEXT: "cut: the context is full", FinishReason.CANCELLED: "stopped",
                  FinishReason.ERROR: "failed"}


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose cache entries were found in a row (an earlier turn's)
    new_tokens: int = 0
    time_to_first_token_s: float = 0.0  # from submission, queueing included
    decode_s: float = 0.0
    finish_reason: FinishReason | str = ""  # "" while running; a remote server may name its own ("tool_calls")
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and checked, and those the model kept
    accepted_tokens: int = 0

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    def summary(self, context: int = 0, engine: bool = False) -> str:
        """A reply's speed and size, and how full the context is (`context` 0: unknown, a remote model):
        the one statistics line of the UI and the terminal chat. `engine` (`--verbose`): with the engine's
        own terms too, the prompt tokens found in its cache, the speculative drafts kept and the finish
        reason's own word."""
        cached = f" ({self.cached_tokens} found in the cache)" if self.cached_tokens and engine else ""
        meter = f" · context: {self.prompt_tokens + self.new_tokens} of {context} tokens" if context else ""
        drafts = (f" · drafts: {self.accepted_tokens} of {self.drafted_tokens} kept "
                  f"({self.accepted_tokens / self.drafted_tokens:.0%})" if self.drafted_tokens and engine else "")
        return (f"{self.new_tokens} tokens · {self.tokens_per_s:.1f} tok/s{drafts} · first token "
                f"{self.time_to_first_token_s * 1000:.0f} ms · prompt {self.prompt_tokens} tokens{cached} · "
                f"{self.ending(engine)}{meter}")

    def ending(self, engine: bool = False) -> str:
        """Why the reply ended, in words (a remote server's own reasons, such as "tool_calls", as it says)."""
        words = None if engine else ENDED_IN_WORDS.get(self.finish_reason)
        return words or f"ended: {self.finish_reason}"


_END = object()


class TokenStream:
    """One request's token ids as the engine produces them. Iterate to receive them (the iteration
    ends when the request finishes; `stats` then holds its finish reason); `cancel` ends the request
    at the engine's next step. Several threads may cancel; one consumes."""

    def __init__(self, cancel: threading.Event | None, keep_logits: bool, logprobs: bool = False):
        self.stats = GenerationStats()
        self.logits: list[Tensor] | None = [] if keep_logits else None  # per token, fp32 on the CPU
        # per token, before it is delivered: (its log-probability, [(id, log-probability)] most likely first)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] | None = [] if logprobs else None
        self._cancel = cancel if cancel is not None else threading.Event()
        self.reason = FinishReason.CANCELLED  # what a cancelled request's finish reason will be
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._ended = False

    def __iter__(self) -> Iterator[int]:
        while not self._ended:
            item = self._items.get()
            if item is _END:
                self._ended = True
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def deliver(self, item: int | BaseException) -> None:
        """Engine side: hand over the next token id, or the error that ends the request."""
        self._items.put(item)

    def end(self, reason: FinishReason) -> None:
        """Engine side: the request is over (a reason set by `cancel` or an earlier error wins)."""
        self.stats.finish_reason = self.stats.finish_reason or reason
        self._items.put(_END)

    def cancel(self, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """End the request; `reason` becomes its finish reason (STOP when a stop string was seen)."""
        self.reason = reason
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self) -> GenerationStats:
        """Drain the stream; the final statistics."""
        for _ in self:
            pass
        return self.stats


class LLMEngine(Protocol):
    """What every LLM backend offers the pipelines."""

    context: int  # positions a sequence may use: prompt and reply together
    vocab_size: int  # the width of the logits (grammars mask this many tokens)
    hidden_size: int  # the width of the embeddings a prompt's slots take
    description: str

    def submit(self, prompt: Prompt, params: SamplingParams, stop_ids: set[int], session: str | None = None,
               cancel: threading.Event | None = None, keep_logits: bool = False,
               grammar: Grammar | None = None) -> TokenStream: ...

    def status(self) -> dict[str, int]: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class TokenLogprob:
    """A reply token's bytes and log-probability, and the most likely tokens at its place."""

    token: bytes
    logprob: float
    top: list[tuple[bytes, float]]


@dataclasses.dataclass
class ChatEvent:
    text: str = ""
    notice: str | None = None
    stats: GenerationStats | None = None  # set on the last event only
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)  # completed by this event
    logprobs: list[TokenLogprob] | None = None  # the tokens read since the last event, where asked for


class ChatModel(Protocol):
    """What the chat pipelines and the service use of a language model, local or remote: messages (or
    plain text) in, `ChatEvent`s out, the last one carrying the statistics."""

    model_id: str
    description: str
    sampling_defaults: Mapping[str, float]  # the model's own values for those an API request leaves out ({}: none)

    @property
    def context(self) -> int:
        """Positions a conversation may use (0: unknown, the remote server fits the prompt)."""
        ...

    def check_chat(self) -> None:
        """Raise `UserError` at load if the model cannot chat (no chat format)."""
        ...

    def count_tokens(self, text: str) -> int:
        """The tokens `text` takes in a prompt (an estimate for a remote model)."""
        ...

    def status(self) -> dict: ...

    def close(self) -> None: ...

    def chat(self, messages: Sequence[dict], params: SamplingParams, cancel: threading.Event | None = None,
             session: str | None = None, structure: Structure = Structure()) -> Iterator[ChatEvent]: ...

    def complete(self, text: str, params: SamplingParams, cancel: threading.Event | None = None,
                 session: str | None = None, structure: Structure = Structure()) -> Iterator[ChatEvent]: ...
