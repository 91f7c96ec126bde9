"""OpenAI's response objects, built from the studio service's updates: `chat.completion`,
`chat.completion.chunk` and `text_completion`, whole or streamed, with usage and errors.

Every shape `/v1` answers in is written here, once; the serving module only sends them.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import secrets
import time

from pipeline.llm.engine.seam import GenerationStats, TokenLogprob
from pipeline.llm.text.tool_calls import ToolCall
from pipeline.service.requests import Update


def _spelled(token: bytes) -> str:
    """A token as OpenAI shows it: its text, with bytes of an unfinished character escaped."""
    return token.decode("utf-8", errors="backslashreplace")


class Choice(abc.ABC):
    """One choice of a response as its updates come: kept for the whole response, or shown as chunks.
    Subclasses lay it out as chat completions or completions do."""

    PREFIX = OBJECT = CHUNK_OBJECT = ""

    def __init__(self, index: int, max_calls: int | None):
        self.index, self.max_calls = index, max_calls  # max_calls: parallel_tool_calls false allows one
        self.updates: list[Update] = []
        self.calls = 0  # tool calls taken so far
        self.stats: GenerationStats | None = None  # set by the choice's last update
        self.sources: list[dict] | None = None  # a reply from a document collection: the sources it cited

    def take(self, update: Update) -> Update | None:
        """`update` as this choice shows it (tool calls past `max_calls` left out), or None when it shows
        nothing; kept for `whole`."""
        self.stats = update.stats or self.stats
        self.sources = update.sources if update.sources is not None else self.sources
        calls = update.tool_calls if self.max_calls is None else update.tool_calls[:max(self.max_calls - self.calls, 0)]
        if not (update.text or calls or update.logprobs):
            return None
        self.calls += len(calls)
        update = dataclasses.replace(update, tool_calls=calls)
        self.updates.append(update)
        return update

    @property
    def ended(self) -> bool:
        return self.stats is not None

    def finish_reason(self) -> str:
        """OpenAI's words: "length" at the token limit or the context's end, "tool_calls", else "stop"
        (an end token or a stop string)."""
        if self.stats is not None and self.stats.finish_reason in ("length", "context"):
            return "length"
        return "tool_calls" if self.calls else "stop"

    def _entries(self) -> list[TokenLogprob] | None:
        """Every token's log-probabilities so far, or None where the request asked for none."""
        if all(u.logprobs is None for u in self.updates):
            return None
        return [e for u in self.updates for e in u.logprobs or []]

    def first(self) -> dict | None:
        """The chunk that opens the choice's stream, if its layout has one."""
        return None

    @abc.abstractmethod
    def delta(self, update: Update) -> dict:
        """The chunk of an update just taken."""

    @abc.abstractmethod
    def last(self) -> dict:
        """The chunk that ends the choice: its finish reason."""

    @abc.abstractmethod
    def whole(self) -> dict:
        """The choice in the whole (unstreamed) response."""


class ChatChoice(Choice):
    """Chat completions' layout: a message with content and tool calls; logprobs as `content` entries."""

    PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def _logprobs(entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        return {"content": [{"token": _spelled(t.token), "logprob": t.logprob, "bytes": list(t.token),
                             "top_logprobs": [{"token": _spelled(b), "logprob": v, "bytes": list(b)} for b, v in t.top]}
                            for t in entries], "refusal": None}

    @staticmethod
    def _calls(calls: list[ToolCall], first: int) -> list[dict]:
        return [{"index": first + i, "id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}} for i, call in enumerate(calls)]

    def first(self) -> dict | None:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, update: Update) -> dict:
        delta = {"content": update.text} if update.text else {}
        if update.tool_calls:
            delta["tool_calls"] = self._calls(update.tool_calls, self.calls - len(update.tool_calls))
        return {"index": self.index, "delta": delta, "logprobs": self._logprobs(update.logprobs), "finish_reason": None}

    def last(self) -> dict:
        delta = {} if self.sources is None else {"sources": self.sources}
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": self.finish_reason()}

    def whole(self) -> dict:
        text = "".join(u.text for u in self.updates)
        calls = self._calls([c for u in self.updates for c in u.tool_calls], 0)
        message = {"role": "assistant", "content": text if text or not calls else None}
        if self.sources is not None:
            message["sources"] = self.sources
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return {"index": self.index, "message": message, "logprobs": self._logprobs(self._entries()),
                "finish_reason": self.finish_reason()}


class CompletionChoice(Choice):
    """Completions' layout: `text`; logprobs as parallel lists of tokens, log-probabilities and offsets."""

    PREFIX, OBJECT, CHUNK_OBJECT = "cmpl", "text_completion", "text_completion"

    def __init__(self, index: int, max_calls: int | None):
        super().__init__(index, max_calls)
        self.offset = 0  # where the next token's text starts in the choice's text

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        offsets = []
        for t in entries:
            offsets.append(self.offset)
            self.offset += len(_spelled(t.token))
        return {"tokens": [_spelled(t.token) for t in entries], "token_logprobs": [t.logprob for t in entries],
                "top_logprobs": [{_spelled(b): v for b, v in t.top} for t in entries], "text_offset": offsets}

    def delta(self, update: Update) -> dict:
        return {"index": self.index, "text": update.text, "logprobs": self._logprobs(update.logprobs),
                "finish_reason": None}

    def last(self) -> dict:
        return {"index": self.index, "text": "", "logprobs": None, "finish_reason": self.finish_reason()}

    def whole(self) -> dict:
        return {"index": self.index, "text": "".join(u.text for u in self.updates),
                "logprobs": self._logprobs(self._entries()), "finish_reason": self.finish_reason()}


class Response:
    """A response's choices under its one id and time: the whole object, or its stream's events."""

    def __init__(self, completion: bool, model: str, n: int, max_calls: int | None):
        kind = CompletionChoice if completion else ChatChoice
        self.kind, self.model = kind, model
        self.ident, self.created = f"{kind.PREFIX}-{secrets.token_hex(12)}", int(time.time())
        self.choices: list[Choice] = [kind(i, max_calls) for i in range(n)]

    def _head(self, chunk: bool) -> dict:
        return {"id": self.ident, "object": self.kind.CHUNK_OBJECT if chunk else self.kind.OBJECT,
                "created": self.created, "model": self.model}

    def usage(self) -> dict:
        """OpenAI's usage: the prompt once (as the first choice read it), every choice's tokens."""
        first = self.choices[0].stats
        prompt = first.prompt_tokens if first else 0
        completion = sum(c.stats.new_tokens for c in self.choices if c.stats)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": first.cached_tokens if first else 0}}

    def whole(self) -> dict:
        return {**self._head(chunk=False), "usage": self.usage(), "choices": [c.whole() for c in self.choices]}

    def event(self, choice: dict | None = None, **extra: object) -> str:
        """A server-sent event of one chunk: `choice`'s (none: a chunk of `extra` only, such as usage)."""
        body = {**self._head(chunk=True), "choices": [choice] if choice else [], **extra}
        return f"data: {json.dumps(body)}\n\n"

    def opening(self) -> list[str]:
        """The events that open the stream: each choice's role chunk, where its layout has one."""
        return [self.event(c) for choice in self.choices if (c := choice.first()) is not None]

    def events(self, index: int, update: Update) -> list[str]:
        """The events one update of choice `index` makes: its delta, and its finish if it was the last."""
        choice = self.choices[index]
        shown = choice.take(update)
        return ([self.event(choice.delta(shown))] if shown is not None else []) + \
            ([self.event(choice.last())] if choice.ended else [])

    def closing(self, include_usage: bool) -> list[str]:
        """The events that end the stream: usage if asked for, then [DONE]."""
        return ([self.event(usage=self.usage())] if include_usage else []) + ["data: [DONE]\n\n"]


def error_event(error: dict) -> str:
    """The event that ends a stream when its request fails after it started."""
    return f"data: {json.dumps({'error': error})}\n\n"
