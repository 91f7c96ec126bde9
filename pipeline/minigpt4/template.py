"""MiniGPT-4's conversation templates, rendered to token ids with a run of image placeholders.

Vicuna v0, as MiniGPT-4's conversation.py renders it (the image lives in the first user turn):
    Give the following image: <Img>ImageContent</Img>. You will be able to see the image once I
    provide it to you. Please answer my questions.###Human: <Img><ImageHere></Img> q1###Assistant: a1###Human: q2###Assistant:
The text around `<ImageHere>` is tokenized segment by segment (BOS only before the first), as
MiniGPT-4 does, and `<ImageHere>` becomes a slot of `num_query` positions in the `Prompt` that the
pipeline fills with the image's query embeddings. User text is always plain text: typing
`<ImageHere>` or `<s>` in a question does not make an image slot or a special token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pipeline.llm.text.prompt import Prompt
from pipeline.llm.text.tokenizer import Tokenizer

IMAGE = object()  # where `segments` puts the image
PLACEHOLDER_ID = 0  # the id a prompt carries inside the image slot (never read: embeddings replace it)
MINIGPT4_SYSTEM = ("Give the following image: <Img>ImageContent</Img>. You will be able to see the image once I "
                   "provide it to you. Please answer my questions.")


@dataclasses.dataclass(frozen=True)
class Template:
    user: str  # text before a user message
    assistant: str  # text before an assistant message (and at the end, where the reply starts)
    sep: str  # after every message
    reply: str  # the prompt's end, where the reply starts
    bos_before_user: bool = False  # LLaMA-2-chat opens every user turn with <s>
    stop_strings: tuple[str, ...] = ()


TEMPLATES = {
    "vicuna_v0": Template(user="Human: ", assistant="Assistant: ", sep="###", reply="Assistant:",
                          stop_strings=("###",)),
    "llama2": Template(user="[INST] ", assistant=" [/INST] ", sep="", reply=" [/INST] ", bos_before_user=True,
                       stop_strings=("[INST]",)),
}


class MiniGPT4Format:
    """A `PromptFormat`: `render` gives ids with one slot of `num_query` positions for the image."""

    def __init__(self, tokenizer: Tokenizer, template: str, num_query: int):
        if template not in TEMPLATES:
            raise ValueError(f"unknown MiniGPT-4 template {template!r}; known: {', '.join(TEMPLATES)}")
        self.tokenizer = tokenizer
        self.template = TEMPLATES[template]
        self.num_query = num_query
        self.bos = tokenizer.bos_id
        self.stop_ids = tokenizer.eos_ids
        self.stop_strings = self.template.stop_strings
        self.tool_calls = None  # Vicuna/LLaMA have no way to write tools

    def segments(self, messages: Sequence[dict]) -> list[str | int | object]:
        """Text pieces (tokenized one by one), ids (BOS) and IMAGE, in prompt order."""
        t = self.template
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else MINIGPT4_SYSTEM
        turns = [m for m in messages if m["role"] != "system"]
        out: list[str | int | object] = [self.bos] if self.bos is not None else []
        text = system + t.sep
        image_placed = False
        for m in turns:
            if m["role"] == "user":
                if t.bos_before_user and self.bos is not None:
                    out += [text, self.bos]
                    text = ""
                text += t.user
                if not image_placed:  # the image rides with the earliest user turn still in the prompt
                    out += [text + "<Img>", IMAGE]
                    text, image_placed = "</Img> ", True
            else:
                text += t.assistant
            text += m["content"] + t.sep
        if turns and turns[-1]["role"] == "assistant":  # continued (Continue): its own text goes on
            return out + [text[:len(text) - len(t.sep)]]
        return out + [text + t.reply]

    def render(self, messages: Sequence[dict], tools: Sequence[dict] = ()) -> Prompt:
        ids: list[int] = []
        slots: list[tuple[int, int]] = []
        for piece in self.segments(messages):
            if piece is IMAGE:
                slots.append((len(ids), self.num_query))
                ids += [PLACEHOLDER_ID] * self.num_query
            elif isinstance(piece, int):
                ids.append(piece)
            elif piece:
                ids += self.tokenizer.encode(piece)
        return Prompt(tuple(ids), tuple(slots))
