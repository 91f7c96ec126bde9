"""The Gradio API's endpoints (`gradio_client`): chat, image chat and the engines' status, apart from
the tabs. Each translates its arguments into one service call; the sampling arguments left out (None)
take `SamplingParams`' defaults, so none is restated here. Nothing is kept in the conversation store."""

from __future__ import annotations

import json
from collections.abc import Iterator

import gradio as gr
from gradio.data_classes import FileData

from app.conversation import client_of, streamed
from app.errors import raised_to_client
from app.image_chat_tab import IMAGE_CHAT_MAX_NEW_TOKENS
from app.sidebar import NO_CONVERSATION
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool


def add_gradio_api(service: StudioService) -> None:
    """Register the endpoints (call inside the `gr.Blocks` being built)."""

    @raised_to_client
    def chat(message: str, history: list[dict] | None = None, system_prompt: str | None = None,
             temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
             repetition_penalty: float | None = None, max_new_tokens: int | None = None, seed: int | None = None,
             request: gr.Request = None) -> Iterator[tuple[str, list[dict], str]]:
        """API: stream a reply to `message` after `history` (a list of {role, content} with text content, or
        the Chatbot's own messages); yields (cleared textbox, history with the growing answer, status).
        A setting left out takes the app's default (seed: random). /stop stops this session's replies."""
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                        max_new_tokens=max_new_tokens, seed=seed)
        updates = service.send(client_of(request), history, message, sampling, system=system_prompt)
        for frame in streamed(updates, NO_CONVERSATION):
            yield "", *frame.outputs[1:3]

    @raised_to_client
    def image_chat(image: FileData | None, message: str, history: list[dict], temperature: float | None = None,
                   top_p: float | None = None, top_k: int | None = None, repetition_penalty: float | None = None,
                   max_new_tokens: int | None = None, seed: int | None = None,
                   request: gr.Request = None) -> Iterator[tuple[list[dict], str]]:
        """API: stream an answer about `image` to `message` after `history` (a list of {role, content});
        yields (history with the growing answer, status). Any file may be sent: what is not a usable
        image gets a clear message. /image_chat_stop stops this session's answer."""
        path = image["path"] if isinstance(image, dict) else image.path if image is not None else None
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                        max_new_tokens=max_new_tokens or IMAGE_CHAT_MAX_NEW_TOKENS, seed=seed)
        updates = service.send(client_of(request), history, message, sampling, tool=Tool.IMAGE_CHAT, image=path)
        for frame in streamed(updates, NO_CONVERSATION):
            yield frame.outputs[1:3]

    def engine_status() -> str:
        """API: JSON with what each LLM engine is doing now ("chat", "image_chat": requests running and
        queued, batch size, cache rows, decode steps so far, prompt tokens prefilled and found in the
        cache; {"loaded": false} while the tool is not loaded), "tools": each tool's state and size,
        and "startup": the start-up report's lines."""
        return json.dumps(service.status())

    gr.api(chat, api_name="chat", concurrency_limit=None)
    gr.api(image_chat, api_name="image_chat", concurrency_limit=None)
    gr.api(engine_status, api_name="engine_status")
