"""The service's message types, a leaf every front end imports: a checked request (`ChatTurn`), where a
reply is kept (`Saved`), and one step of a reply as it reaches a front end (`Update`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np

from pipeline.llm.engine.seam import GenerationStats, TokenLogprob
from pipeline.llm.engine.params import NEUTRAL, SamplingParams
from pipeline.llm.text.structure import Structure
from pipeline.llm.text.tool_calls import ToolCall
from pipeline.service.tools import Tool

STOPPED = "Stopped: the reply so far is kept."
ImageSource = str | bytes | np.ndarray


def checked_params(sampling: Mapping[str, Any] | None, model_defaults: bool) -> tuple[SamplingParams, frozenset[str]]:
    """The request's sampling values checked, and which of them the answering model decides: with
    `model_defaults`, those of `NEUTRAL`'s left out (None) are neutral until the model's own replace them
    (`ChatTurn.for_model`); else every value left out is `SamplingParams`' own (the UI's)."""
    values = dict(sampling or {})
    unset = frozenset(name for name in NEUTRAL if values.get(name) is None) if model_defaults else frozenset()
    return SamplingParams.from_values(**{**values, **{name: NEUTRAL[name] for name in unset}}), unset


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    """A checked request for a reply: the tool that answers, plain {role, content} messages ending
    with the user's, the sampling parameters, and the picture for image chat."""

    tool: Tool
    messages: tuple[dict, ...]
    params: SamplingParams
    image: np.ndarray | None = dataclasses.field(default=None, repr=False)
    model: str | None = None  # the chat model asked for (switched to first if another runs); None: the one running
    structure: Structure = Structure()  # tools offered, a JSON schema the reply follows
    prompt: str | None = None  # a plain text to continue instead of `messages` (`/v1/completions`)
    model_defaults: frozenset[str] = frozenset()  # sampling values left to the answering model (`for_model`)
    collection: str | None = None  # the document collection the question is answered from, with citations

    def for_model(self, defaults: Mapping[str, float]) -> ChatTurn:
        """This turn as the model with its own sampling `defaults` answers it: those it left to the model
        taken from them (the rest keep `params`' neutral values)."""
        taken = {name: defaults[name] for name in self.model_defaults if name in defaults}
        return dataclasses.replace(self, params=dataclasses.replace(self.params, **taken)) if taken else self


class Revision(enum.StrEnum):
    """What a message sent to a stored conversation is: a new turn, another reply to the last question
    (regenerate) or another version of the last question (edit). The old ones stay, as versions."""

    NEW = "new"
    REPLY = "reply"
    QUESTION = "question"


@dataclasses.dataclass(frozen=True)
class Saved:
    """Where a reply is kept: `user`'s `conversation` in the service's store (None: start one with the
    first message, `StudioService.send`), as a new turn or another version of the last one."""

    user: str
    conversation: int | Future | None = None  # a Future: one being created while another program locks the database
    revision: Revision = Revision.NEW


@dataclasses.dataclass
class Update:
    """One step of a reply as a front end shows it: more `text`, the `status` line (loading progress,
    "generating…", then the statistics), a `notice` to show once, and the statistics at the end."""

    text: str = ""
    status: str = ""
    notice: str | None = None
    stats: GenerationStats | None = None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    saved: Saved | None = None  # where the reply is kept (a conversation just started has its id here)
    messages: tuple[dict, ...] = ()  # in the first update: the conversation the reply follows, checked
    logprobs: list[TokenLogprob] | None = None
    sources: list[dict] | None = None  # in the last update of a reply from a collection: the sources it cited
    # (`Library.shown`: number, file, place, text, link)


def stats_line(stats: GenerationStats, context: int = 0, engine: bool = False) -> str:
    """The reply's statistics line (`engine`: with the engine's terms), marked when the user stopped it."""
    line = stats.summary(context, engine)
    return f"{STOPPED} {line}" if stats.finish_reason == "cancelled" else line
