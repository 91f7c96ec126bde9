"""Chat messages → prompt token ids, fitted to the context window.

Formats share one `PromptFormat` protocol: the checkpoint's own chat template where its tokenizer
config has one, else ChatML built piece by piece as Qwen v1 does (`<|im_start|>role\\ncontent<|im_end|>\\n`),
so user text can never inject special tokens; MiniGPT-4's templates live beside its model. When a
conversation outgrows the context, the oldest turns go first (the system prompt stays), and a
single over-long message is cut in the middle; each cut comes back as a notice for the UI.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pipeline.errors import UserError
from pipeline.llm.text.tokenizer import ENDOFTEXT, IM_END, IM_START, Tokenizer
from pipeline.llm.text.tool_calls import ReActCalls, TaggedCalls, TaggedCallsInMessages

if TYPE_CHECKING:  # annotations only: the contract imports no torch
    from torch import Tensor

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """Token ids, where `slots` ((start, length) runs) take their inputs from `embeds` instead.

    Ids inside a slot are placeholders. `keys` name each slot's content (an image hash) so an
    engine can recognise a cached prefix that includes it. `rope`: M-RoPE positions [3, len] (time,
    row, column) where a model places a picture's tokens on a grid (Qwen2.5-VL); None: token i at i.
    """

    ids: tuple[int, ...]
    slots: tuple[tuple[int, int], ...] = ()
    embeds: tuple[Tensor, ...] = ()
    keys: tuple[str, ...] = ()
    rope: Tensor | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def shift(self, at: int) -> int:
        """How far a text token at index `at` sits from its rotary position (past the prompt: a reply's)."""
        if self.rope is None:
            return 0
        if at >= len(self.ids):
            return self._end_shift
        return int(self.rope[0, at]) - at

    @functools.cached_property
    def _end_shift(self) -> int:
        return int(self.rope.max()) + 1 - len(self.ids)

    def fill(self, embeds: Tensor, key: str) -> Prompt:
        """Every slot filled with `embeds` [length, hidden] (MiniGPT-4 shows one image per prompt)."""
        for _, length in self.slots:
            if length != embeds.shape[0]:
                raise ValueError(f"a slot of {length} positions cannot hold {embeds.shape[0]} embeddings")
        return dataclasses.replace(self, embeds=(embeds,) * len(self.slots), keys=(key,) * len(self.slots))

    def signature(self) -> list:
        """What identifies each position's input: its id, or (content key, offset) inside a slot."""
        sig: list = list(self.ids)
        for (start, length), key in zip(self.slots, self.keys):
            sig[start:start + length] = [(key, i) for i in range(length)]
        return sig


def expand_images(ids: Sequence[int], image_id: int, images: Sequence[Prompt]) -> Prompt:
    """A rendered prompt's ids with its i-th `image_id` (a VLM's one image token per picture) replaced by
    `images[i]`'s ids, their slots moved to their places: the ids a VLM's processor gives the same text with
    those pictures."""
    places = [i for i, token in enumerate(ids) if token == image_id]
    if len(places) != len(images):
        raise UserError(f"the prompt has {len(places)} image places but {len(images)} images were given")
    out: list[int] = []
    slots: list[tuple[int, int]] = []
    start = 0
    for place, piece in zip(places, images):
        out.extend(ids[start:place])
        slots.extend((len(out) + begin, length) for begin, length in piece.slots)
        out.extend(piece.ids)
        start = place + 1
    out.extend(ids[start:])
    return Prompt(tuple(out), tuple(slots))


class PromptFormat(Protocol):
    """How a model wants a conversation written: ChatML, a checkpoint's chat template, MiniGPT-4's
    templates. `render` gives the prompt (an assistant message last is continued, not closed; `tools`
    listed where the format writes them itself); a reply ends at a stop id or a stop string.
    `tool_calls`: how the model writes tools and calls, None where it cannot."""

    tokenizer: Tokenizer
    stop_ids: set[int]
    stop_strings: tuple[str, ...]
    tool_calls: TaggedCalls | ReActCalls | None

    def render(self, messages: Sequence[dict], tools: Sequence[dict] = ()) -> Prompt: ...


# A model may spell the end marker as text instead of emitting the special token.
CHATML_STOP_STRINGS = (IM_END, IM_START)


def _chatml_stop_ids(tokenizer: Tokenizer) -> set[int]:
    return tokenizer.eos_ids | ({tokenizer.special_id(t) for t in (IM_START, IM_END, ENDOFTEXT)} - {None})


class ChatMLFormat:
    """ChatML built piece by piece as Qwen v1 does, so user text can never inject special tokens."""

    def __init__(self, tokenizer: Tokenizer):
        if tokenizer.special_id(IM_START) is None or tokenizer.special_id(IM_END) is None:
            raise UserError("this tokenizer has neither a chat template nor ChatML tokens; cannot build chat prompts")
        self.tokenizer = tokenizer
        self.stop_ids = _chatml_stop_ids(tokenizer)
        self.stop_strings = CHATML_STOP_STRINGS
        self.tool_calls = ReActCalls()  # tools go into the messages (`ReActCalls.messages`), not a template

    def render(self, messages: Sequence[dict], tools: Sequence[dict] = ()) -> Prompt:
        tok = self.tokenizer
        start, end, newline = tok.special_id(IM_START), tok.special_id(IM_END), tok.encode("\n")
        ids: list[int] = []
        for m in messages:
            ids += [start] + tok.encode(m["role"]) + newline + tok.encode(m["content"]) + [end] + newline
        if messages and messages[-1]["role"] == "assistant":  # continued: no end of turn
            return Prompt(tuple(ids[:-1 - len(newline)]))
        return Prompt(tuple(ids + [start] + tok.encode("assistant") + newline))


class ChatTemplateFormat:
    """The checkpoint's own chat template (its tokenizer config's Jinja), with ChatML's stops. Tools:
    the template writes them where it can (Qwen2.5's); a ChatML template that cannot (SmolLM2's) gets
    Qwen2.5's layout in its messages (`TaggedCallsInMessages`); any other template has no tools."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.stop_ids = _chatml_stop_ids(tokenizer)
        self.stop_strings = CHATML_STOP_STRINGS
        chatml = IM_START in tokenizer.chat_template and tokenizer.special_id(IM_START) is not None
        self.tool_calls = (TaggedCalls() if tokenizer.template_takes_tools
                           else TaggedCallsInMessages() if chatml else None)

    def render(self, messages: Sequence[dict], tools: Sequence[dict] = ()) -> Prompt:
        return Prompt(tuple(self.tokenizer.render_chat_template(list(messages), list(tools) or None)))


def chat_format(tokenizer: Tokenizer) -> PromptFormat:
    """The checkpoint's chat template where its tokenizer config has one, else ChatML."""
    return ChatTemplateFormat(tokenizer) if tokenizer.chat_template is not None else ChatMLFormat(tokenizer)


MAX_MESSAGES = 2000  # per request: a client sending 10,000 turns is refused, not given minutes of CPU


def check_messages(messages: Sequence[dict]) -> None:
    """Reject what no model can answer, with a reason a person understands."""
    if not messages:
        raise UserError("the conversation is empty: type a message first")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UserError(f"malformed message {m!r}: expected {{'role': one of {ROLES}, 'content': text}}")
    if messages[-1]["role"] == "system":
        raise UserError("the last message must be the user's (or a tool's result, or an assistant reply to continue)")
    if messages[-1]["role"] == "user" and not messages[-1]["content"].strip():
        raise UserError("the message is empty: type something to send")


def fit_prompt(fmt: PromptFormat, messages: Sequence[dict], budget: int,
               tools: Sequence[dict] = ()) -> tuple[Prompt, list[str]]:
    """A prompt of at most `budget` tokens, and notices saying what had to go: the oldest turns (whole,
    from a user message on), then the middle of an over-long last message.

    Which turns to keep is a binary search over where the kept part starts (a prompt only shrinks
    as turns go), so a long history costs a few renders, not one per dropped turn."""
    check_messages(messages)
    if len(messages) > MAX_MESSAGES:
        raise UserError(f"the conversation has {len(messages)} messages; the limit is {MAX_MESSAGES}: start a new "
                        f"chat (the oldest turns could not reach the model anyway)")
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = list(messages[len(system):])
    notices = []
    starts = [0] + [i for i in range(1, len(turns)) if turns[i]["role"] == "user"]  # the last is the question
    lo, hi = 0, len(starts) - 1
    while lo < hi:  # the first start whose prompt fits (or the last, which keeps only the question)
        mid = (lo + hi) // 2
        if len(fmt.render(system + turns[starts[mid]:], tools)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    dropped = starts[lo]
    turns = turns[dropped:]
    prompt = fmt.render(system + turns, tools)
    if dropped:
        notices.append(f"The conversation outgrew the model's context: the {dropped} oldest "
                       f"message{'s' if dropped > 1 else ''} no longer reach the model.")
    if len(prompt) > budget:
        content_ids = fmt.tokenizer.encode(turns[-1]["content"])
        keep = len(content_ids)
        while len(prompt) > budget:  # re-tokenization at the cut can shift a token or two: retry
            keep -= len(prompt) - budget + 2
            if keep < 16:
                raise UserError("the system prompt leaves no room for a message; shorten it or raise the context")
            turns[-1] = {**turns[-1], "content": _cut_middle(fmt.tokenizer, content_ids, keep)}
            prompt = fmt.render(system + turns, tools)
        notices.append(f"Your message was {len(content_ids)} tokens, too long for the context: "
                       f"its middle was cut, keeping the first and last {keep // 2} tokens.")
    return prompt, notices


def _cut_middle(tokenizer: Tokenizer, ids: list[int], keep: int) -> str:
    head, tail = ids[:keep // 2], ids[len(ids) - (keep - keep // 2):]
    return tokenizer.decode(head) + " … " + tokenizer.decode(tail)
