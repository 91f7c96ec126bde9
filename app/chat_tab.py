"""The Chat tab: wiring between Gradio components and the studio service (no request rules here)."""

from __future__ import annotations

import gradio as gr

from app.conversation import client_of, streamed, user_of, wire_stop
from app.conversation_files import to_json, to_markdown
from app.downloads import download_on_click, write_download
from app.errors import shown_to_user
from app.sampling_form import SamplingForm
from app.sidebar import NO_CONVERSATION, Sidebar, history_of
from pipeline.errors import UserError
from pipeline.service.messages import plain_messages
from pipeline.service.requests import Saved
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool

DEFAULT_SYSTEM = "You are a helpful assistant."
PRESETS = {  # system prompts people reach for, one click away
    "Helpful assistant": DEFAULT_SYSTEM,
    "Concise": "You are a helpful assistant. Answer in as few words as the question allows.",
    "Coding helper": "You are an expert programmer. Answer with working code in fenced code blocks, then a short "
                     "explanation.",
    "Translator": "Translate everything the user writes into English, keeping its tone. Output only the translation.",
    "Teacher": "You are a patient teacher. Explain step by step and check understanding with a question.",
}


def build_chat_tab(service: StudioService, app: gr.Blocks, storage_secret: str) -> None:
    """`storage_secret` encrypts which conversation is open, kept in the browser's localStorage so a
    reload reopens it (the conversations themselves are in the store)."""

    def saved(current: int, request: gr.Request) -> Saved:
        return Saved(user_of(request), None if current == NO_CONVERSATION else current)

    @shown_to_user
    def respond(data: dict, request: gr.Request):
        """Stream a reply to the message, kept in the open conversation (a new one if none is open)."""
        updates = service.send(client_of(request), data[chatbot], data[message], form.values(data),
                               system=data[system_prompt], saved=saved(data[current], request))
        yield from streamed(updates, data[current])

    @shown_to_user
    def regenerate(data: dict, request: gr.Request):
        """The last reply again (a new draw, unless the seed is fixed)."""
        updates = service.regenerate(client_of(request), data[chatbot], form.values(data),
                                     system=data[system_prompt], saved=saved(data[current], request))
        yield from streamed(updates, data[current])

    @shown_to_user
    def edit_last(history: list, conversation: int, request: gr.Request) -> tuple[str, list[dict], str]:
        """The last message back in the textbox to edit and resend; it and its reply leave the chat."""
        before, last = service.edit_last(history, saved(conversation, request))
        return last, before, "Editing your last message: change it and press Enter."

    @shown_to_user
    def export(history: list, system_prompt: str, kind: str) -> str:
        history = plain_messages(history)
        if not history:
            raise UserError("nothing to export yet: the conversation is empty")
        text = to_json(history, system_prompt) if kind == "json" else to_markdown(history, system_prompt)
        return write_download(text.encode(), "conversation-", f".{kind if kind == 'json' else 'md'}")

    with gr.Row():
        with gr.Column(scale=1, min_width=200):
            sidebar = Sidebar(Tool.CHAT, "chat", storage_secret)
        with gr.Column(scale=4):
            chatbot = gr.Chatbot(label="Chat", height=520, buttons=["copy", "copy_all"], elem_id="chat-history")
            with gr.Row():
                message = gr.Textbox(placeholder="Type a message, Enter to send", show_label=False, scale=6,
                                     autofocus=True)
                send = gr.Button("Send", variant="primary", scale=1)
            with gr.Row():
                stop = gr.Button("Stop")
                regen = gr.Button("Regenerate")
                edit = gr.Button("Edit last")
            with gr.Row():
                export_json = gr.Button("Export JSON", size="sm")
                export_md = gr.Button("Export Markdown", size="sm")
            status = gr.Markdown("", elem_id="chat-status")
        with gr.Column(scale=2):
            preset = gr.Dropdown(list(PRESETS), value="Helpful assistant", label="System prompt preset",
                                 elem_id="chat-preset")
            system_prompt = gr.Textbox(DEFAULT_SYSTEM, label="System prompt", lines=3, elem_id="chat-system")
            form = SamplingForm("chat")

    current = sidebar.current
    sidebar.wire(service, app, [chatbot, system_prompt],
                 lambda found: (history_of(found), found["system"] if found["system"] is not None else gr.skip()),
                 lambda: ([], gr.skip()), status)
    inputs = {message, chatbot, system_prompt, current, *form.components}
    outputs = [message, chatbot, status, current]
    # No concurrency limit: the engine batches every session's reply (and queues past its batch).
    for event in (message.submit(respond, inputs, outputs, api_visibility="private", concurrency_limit=None),
                  send.click(respond, inputs, outputs, api_visibility="private", concurrency_limit=None),
                  regen.click(regenerate, inputs, outputs, api_visibility="private", concurrency_limit=None)):
        event.then(**sidebar.relist)
    edit.click(edit_last, [chatbot, current], [message, chatbot, status], api_visibility="private")
    preset.change(lambda name: PRESETS[name], preset, system_prompt, api_visibility="private")
    download_on_click(export_json, lambda h, s: export(h, s, "json"), [chatbot, system_prompt], "chat-export-json")
    download_on_click(export_md, lambda h, s: export(h, s, "md"), [chatbot, system_prompt], "chat-export-md")
    wire_stop(stop, service, Tool.CHAT, "stop")
