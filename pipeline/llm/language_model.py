"""A tokenizer and an LLM engine: the reply loop that text chat and image chat share.

`reply` yields `ChatEvent`s rather than bare strings so that notices (turns dropped from the
context, a cut message) and the final statistics travel with the text to the UI and the API. It
works the same over every engine: it fits the prompt, submits it, and turns token ids into
UTF-8-safe text, cancelling the request when a stop string appears, when the caller's cancel flag
is set, or when the caller stops listening (a closed tab, a dropped API client).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from pipeline.errors import UserError
from pipeline.llm.engine.seam import ChatEvent, ChatModel, FinishReason, LLMEngine, TokenLogprob, TokenStream
from pipeline.llm.text.grammar import GrammarVocabulary, json_schema_grammar
from pipeline.llm.text.prompt import Prompt, PromptFormat, chat_format, fit_prompt
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.streaming import TextStream
from pipeline.llm.text.structure import Structure
from pipeline.llm.text.tokenizer import Tokenizer
from pipeline.llm.text.tool_calls import CallReader


class LanguageModel(ChatModel):
    """A tokenizer and a local engine: the `ChatModel` of every local backend."""

    def __init__(self, tokenizer: Tokenizer, engine: LLMEngine, model_id: str, description: str,
                 sampling_defaults: Mapping[str, float] | None = None):
        """`sampling_defaults`: the checkpoint's own sampling values (`checkpoint_defaults`), for API
        requests that leave them out."""
        self.tokenizer, self.engine, self.model_id = tokenizer, engine, model_id
        self.description = description
        self.sampling_defaults = dict(sampling_defaults or {})
        self._vocabularies: dict[frozenset[int], GrammarVocabulary] = {}

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

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def status(self) -> dict:
        """What the engine is doing now (for `/engine_status`)."""
        return self.engine.status()

    def chat(self, messages: Sequence[dict], params: SamplingParams, cancel: threading.Event | None = None,
             session: str | None = None, structure: Structure = Structure(), fmt: PromptFormat | None = None,
             fill: Callable[[Prompt], Prompt] | None = None) -> Iterator[ChatEvent]:
        """Reply to `messages` in prompt format `fmt` (default: the model's own chat format), a few
        characters at a time (the last message the user's or a tool's; an assistant's is continued).

        `fill` completes the prompt's embedding slots (image chat's image); `session` names the
        conversation so the engine can reuse its earlier turns; `structure` offers tools and asks
        for JSON. Raises `UserError` for bad input or out-of-memory; a set `cancel` ends the reply
        early, keeping what was said so far.
        """
        fmt = fmt or self.format
        calls = fmt.tool_calls
        uses_tools = structure.offers_tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if uses_tools and calls is None:
            raise UserError("this model's prompt format cannot express tools (LLaMA/Vicuna have none): send no "
                            "tools or tool messages", "tools")
        tools = structure.tools if structure.offers_tools else ()
        if uses_tools:
            messages = calls.messages(messages, tools)
        reply_room = min(params.max_new_tokens, self.context // 2)
        prompt, notices = fit_prompt(fmt, messages, self.context - reply_room, tools)
        for notice in notices:
            yield ChatEvent(notice=notice)
        if fill is not None:
            prompt = fill(prompt)
        if structure.forced:
            grammar = (calls.grammar(structure.forced), "tools")
        elif structure.schema is not None:
            grammar = (json_schema_grammar(structure.schema), "response_format")
        else:
            grammar = None
        stops = (*fmt.stop_strings, *(calls.stop_strings if tools else ()), *params.stop)
        reader = calls.reader() if tools else None
        yield from self._generate(prompt, params, fmt.stop_ids, stops, cancel, session, grammar, reader)

    def complete(self, text: str, params: SamplingParams, cancel: threading.Event | None = None,
                 session: str | None = None, structure: Structure = Structure()) -> Iterator[ChatEvent]:
        """Continue the plain `text` (no chat format: `/v1/completions`) until an end-of-text id, a stop
        string or the token limit."""
        if structure.tools:
            raise UserError("a plain completion cannot call tools: use chat completions", "tools")
        ids = ([self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []) + self.tokenizer.encode(text)
        if not text:
            raise UserError("the prompt is empty: send text to continue", "prompt")
        kept = min(params.max_new_tokens, self.context // 2)  # as `chat` keeps room for the reply
        if len(ids) > self.context - kept:
            why = "max_tokens" if kept == params.max_new_tokens else "half the context, as max_tokens is more"
            raise UserError(f"the prompt is {len(ids)} tokens, but this model's context is {self.context} tokens and "
                            f"{kept} of them are kept for the reply ({why}): send at most {self.context - kept} "
                            f"prompt tokens, or ask for fewer max_tokens", "prompt")
        grammar = None if structure.schema is None else (json_schema_grammar(structure.schema), "response_format")
        yield from self._generate(Prompt(tuple(ids)), params, self.tokenizer.eos_ids, params.stop, cancel, session,
                                  grammar, None, strip=False)

    def _generate(self, prompt: Prompt, params: SamplingParams, stop_ids: set[int], stop_strings: Sequence[str],
                  cancel: threading.Event | None, session: str | None, grammar: tuple[str, str] | None,
                  reader: CallReader | None, strip: bool = True) -> Iterator[ChatEvent]:
        """Run `prompt` on the engine and turn its tokens into events: UTF-8-safe text cut at the stop
        strings, read for tool calls by `reader`, with log-probabilities where asked for."""
        matcher = None if grammar is None else self._vocabulary(stop_ids).grammar(*grammar)
        stream = self.engine.submit(prompt, params, stop_ids, session=session, cancel=cancel, grammar=matcher)
        text = TextStream(self.tokenizer, stop_strings)
        started = not strip
        try:
            for index, token_id in enumerate(stream):
                piece = text.push(token_id)
                if not started:  # SentencePiece replies start with the space of "▁word"
                    piece = piece.lstrip()
                    started = bool(piece)
                event = ChatEvent(logprobs=self._logprobs(stream, index, token_id))
                event.text, event.tool_calls = reader.push(piece) if reader is not None else (piece, [])
                if event.text or event.tool_calls or event.logprobs:
                    yield event
                if text.stopped:
                    stream.cancel(FinishReason.STOP)
                    break
        finally:  # the caller stopped listening (GeneratorExit here): the engine drops the request
            if not stream.cancelled:
                stream.cancel()
        stats = stream.wait()
        tail = text.finish()
        tail = tail if started else tail.lstrip()
        event = ChatEvent(stats=stats, notice="The reply reached the end of the model's context window."
                          if stats.finish_reason == FinishReason.CONTEXT else None)
        if reader is not None:
            event.text, event.tool_calls = reader.push(tail)
            more, calls = reader.finish()
            event.text, event.tool_calls = event.text + more, event.tool_calls + calls
        else:
            event.text = tail
        yield event

    def _logprobs(self, stream: TokenStream, index: int, token_id: int) -> list[TokenLogprob] | None:
        """The reply's `index`th token as `[TokenLogprob]`, where the request asked for log-probabilities."""
        if stream.logprobs is None:
            return None
        piece, (logprob, top) = self.tokenizer.token_bytes, stream.logprobs[index]
        return [TokenLogprob(piece(token_id), logprob, [(piece(i), value) for i, value in top])]

    def _vocabulary(self, stop_ids: set[int]) -> GrammarVocabulary:
        """The grammar library's view of the vocabulary with these end ids (made once per format)."""
        key = frozenset(stop_ids)
        if key not in self._vocabularies:
            self._vocabularies[key] = GrammarVocabulary(self.tokenizer, self.engine.vocab_size, set(stop_ids))
        return self._vocabularies[key]
