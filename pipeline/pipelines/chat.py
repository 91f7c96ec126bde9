"""ChatPipeline: messages in, streamed text out, over whichever LLM engine the factory picked."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from pipeline.llm.engine.seam import ChatEvent, ChatModel
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.structure import Structure


class ChatPipeline:
    def __init__(self, llm: ChatModel, is_demo: bool = False):
        llm.check_chat()  # a model with no chat format is refused at load, not at the first message
        self.llm = llm
        self.is_demo = is_demo
        self.title, self.description = llm.model_id, llm.description

    def close(self) -> None:
        """Free the model (the tool is being unloaded)."""
        self.llm.close()

    def stream(self, messages: Sequence[dict], params: SamplingParams, cancel: threading.Event | None = None,
               session: str | None = None, structure: Structure = Structure()) -> Iterator[ChatEvent]:
        """Reply to `messages` in the model's chat format, streamed; see `ChatModel.chat`.
        `session` names the conversation, so its next turn prefills only what is new."""
        return self.llm.chat(messages, params, cancel, session, structure)

    def complete(self, text: str, params: SamplingParams, cancel: threading.Event | None = None,
                 session: str | None = None, structure: Structure = Structure()) -> Iterator[ChatEvent]:
        """Continue plain `text`, streamed; see `ChatModel.complete`."""
        return self.llm.complete(text, params, cancel, session, structure)
