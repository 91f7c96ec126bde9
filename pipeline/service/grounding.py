"""A chat turn tied to a document collection: the question's sources found and put into the prompt, numbered, as
many as the chat model has room for; the reply's citations checked as it streams (`CitationStream`)."""

from __future__ import annotations

import dataclasses

from pipeline.docs.citations import sources_prompt
from pipeline.docs.library import Library
from pipeline.docs.retrieval import Source
from pipeline.llm.engine.seam import ChatModel
from pipeline.service.requests import ChatTurn

MOST_SOURCE_TOKENS = 1500  # more slows a CPU's prompt, and small models read a long one worse
MARGIN = 64  # tokens of the chat format around the messages


def source_budget(turn: ChatTurn, llm: ChatModel) -> int:
    """Tokens the sources may take: a quarter of the model's context at most, and what the conversation and the
    reply leave of it (a remote model's context is the server's: the cap alone)."""
    if not llm.context:
        return MOST_SOURCE_TOKENS
    said = sum(llm.count_tokens(m["content"]) for m in turn.messages)
    room = llm.context - min(turn.params.max_new_tokens, llm.context // 2) - said - MARGIN
    return max(0, min(MOST_SOURCE_TOKENS, llm.context // 4, room))


def grounded(turn: ChatTurn, library: Library, llm: ChatModel) -> tuple[ChatTurn, list[Source]]:
    """`turn` with its last question carrying the sources found for it in `turn.collection` (a reply continued
    goes on from the same ones), and those sources."""
    at = max((i for i, m in enumerate(turn.messages) if m["role"] == "user"), default=None)
    if at is None:
        return turn, []
    question = turn.messages[at]["content"]
    sources = library.sources(turn.collection, question, source_budget(turn, llm), llm.count_tokens)
    asked = {**turn.messages[at], "content": sources_prompt(question, sources)}
    return dataclasses.replace(turn, messages=(*turn.messages[:at], asked, *turn.messages[at + 1:])), sources
