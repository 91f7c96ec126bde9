"""The Chat tab: wiring between Gradio components and `ChatPipeline` (no model logic here)."""

from __future__ import annotations

from collections.abc import Iterator

import gradio as gr

from app.conversation import CancelFlags, sampling_controls, start_turn, stream_turn, wire_stop
from app.errors import shown_to_user
from pipeline.errors import UserError
from pipeline.tools import ToolHost

DEFAULT_SYSTEM = "You are a helpful assistant."


def build_chat_tab(tools: ToolHost, app: gr.Blocks, storage_secret: str) -> None:
    """`storage_secret` encrypts the conversation kept in the browser's localStorage, so a reload or
    an app restart does not lose it (the secret must outlive the process for the latter)."""
    flags = CancelFlags()

    @shown_to_user
    def respond(message: str, history: list, system_prompt: str, temperature: float, top_p: float, top_k: int,
                repetition_penalty: float, max_new_tokens: int, seed: int, request: gr.Request):
        """Stream a reply to `message`; yields (textbox, chat history, status). Seed -1 = random."""
        params, history = start_turn(message, history, (temperature, top_p, top_k, repetition_penalty,
                                                        max_new_tokens, seed))
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise UserError(f"system_prompt must be text, got {system_prompt!r:.60}")
        system = [{"role": "system", "content": system_prompt}] if system_prompt and system_prompt.strip() else []
        messages = system + history + [{"role": "user", "content": message}]
        yield from stream_turn(tools, "chat", lambda chat, cancel, session: chat.stream(messages, params, cancel,
                                                                                        session),
                               history, message, flags, request)

    with gr.Row():
        with gr.Column(scale=4):
            chatbot = gr.Chatbot(label="Chat", height=520, buttons=["copy", "copy_all"])
            with gr.Row():
                message = gr.Textbox(placeholder="Type a message, Enter to send", show_label=False, scale=6,
                                     autofocus=True)
                send = gr.Button("Send", variant="primary", scale=1)
            with gr.Row():
                stop = gr.Button("Stop")
                clear = gr.Button("New chat")
            status = gr.Markdown("", elem_id="chat-status")
        with gr.Column(scale=2):
            system_prompt = gr.Textbox(DEFAULT_SYSTEM, label="System prompt", lines=3)
            sampling = sampling_controls("chat")

    saved = gr.BrowserState([], storage_key="ai-studio-chat", secret=storage_secret)
    inputs = [message, chatbot, system_prompt, *sampling]
    outputs = [message, chatbot, status]
    keep = dict(fn=lambda history: history, inputs=chatbot, outputs=saved, api_visibility="private")
    # No concurrency limit: the engine batches every session's reply (and queues past its batch).
    on_enter = message.submit(respond, inputs, outputs, api_visibility="private", concurrency_limit=None)
    on_send = send.click(respond, inputs, outputs, api_visibility="private", concurrency_limit=None)
    on_enter.then(**keep)
    on_send.then(**keep)

    wire_stop(stop, flags, status, "stop")
    clear.click(lambda: ([], "", ""), None, [chatbot, message, status], api_visibility="private").then(**keep)
    app.load(lambda history: history, saved, chatbot, api_visibility="private")

    def chat(message: str, history: list[dict] | None = None, system_prompt: str = DEFAULT_SYSTEM,
             temperature: float = 0.7, top_p: float = 0.8, top_k: int = 20, repetition_penalty: float = 1.05,
             max_new_tokens: int = 512, seed: int = -1, request: gr.Request = None
             ) -> Iterator[tuple[str, list[dict], str]]:
        """API: stream a reply to `message` after `history` (a list of {role, content} with text content, or
        the Chatbot's own messages); yields (cleared textbox, history with the growing answer, status).
        Seed -1 = random. /stop stops this session's replies."""
        yield from respond(message, history, system_prompt, temperature, top_p, top_k, repetition_penalty,
                           max_new_tokens, seed, request)

    gr.api(chat, api_name="chat", concurrency_limit=None)
