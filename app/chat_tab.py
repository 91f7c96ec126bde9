"""The Chat tab: wiring between Gradio components and the studio service (no request rules here)."""

from __future__ import annotations

from collections.abc import Iterator

import gradio as gr

from app.conversation import SLIDERS, sampling_controls, stream_turn, user_of, wire_stop
from app.conversation_files import to_json, to_markdown
from app.downloads import download_on_click, write_download
from app.errors import shown_to_user
from app.sidebar import NO_CONVERSATION, Sidebar, history_of
from pipeline.errors import UserError
from pipeline.service.studio import CHAT, Saved, StudioService, plain_messages

DEFAULT_SYSTEM = "You are a helpful assistant."
PRESETS = {  # system prompts people reach for, one click away
    "Helpful assistant": DEFAULT_SYSTEM,
    "Concise": "You are a helpful assistant. Answer in as few words as the question allows.",
    "Coding helper": "You are an expert programmer. Answer with working code in fenced code blocks, then a short "
                     "explanation.",
    "Translator": "Translate everything the user writes into English, keeping its tone. Output only the translation.",
    "Teacher": "You are a patient teacher. Explain step by step and check understanding with a question.",
}


def last_turn(history: list) -> tuple[list[dict], str]:
    """(the history before the last user message, that message), for regenerate and edit."""
    history = plain_messages(history)
    while history and history[-1]["role"] == "assistant":
        history.pop()
    if not history or history[-1]["role"] != "user":
        raise UserError("there is no message of yours to regenerate or edit yet")
    return history[:-1], history[-1]["content"]


def build_chat_tab(service: StudioService, app: gr.Blocks, storage_secret: str) -> None:
    """`storage_secret` encrypts which conversation is open, kept in the browser's localStorage so a
    reload reopens it (the conversations themselves are in the store)."""

    def reply(message: str, history: list, system_prompt: str, sampling: tuple, request: gr.Request,
              saved: Saved | None):
        turn = service.chat_turn(plain_messages(history, "history") + [{"role": "user", "content": message}],
                                 dict(zip(SLIDERS, sampling)), system=system_prompt, tool=CHAT)
        yield from stream_turn(service, turn, request, saved)

    @shown_to_user
    def respond(message: str, history: list, system_prompt: str, temperature: float, top_p: float, top_k: int,
                repetition_penalty: float, max_new_tokens: int, seed: int, current: int,
                request: gr.Request):
        """Stream a reply to `message`, kept in the conversation `current` (a new one if none is open); yields
        (textbox, chat history, status, conversation). Seed -1 = random."""
        user = user_of(request)
        if current == NO_CONVERSATION:
            current = service.store.create(user, CHAT, system=system_prompt)
        for out in reply(message, history, system_prompt, (temperature, top_p, top_k, repetition_penalty,
                                                           max_new_tokens, seed), request, Saved(user, current)):
            yield *out, current

    @shown_to_user
    def regenerate(history: list, system_prompt: str, temperature: float, top_p: float, top_k: int,
                   repetition_penalty: float, max_new_tokens: int, seed: int, current: int,
                   request: gr.Request):
        """The last reply again (a new draw, unless the seed is fixed): the same message, resent."""
        before, message = last_turn(history)
        if current != NO_CONVERSATION:
            service.store.drop_last_turn(user_of(request), current)
        yield from respond(message, before, system_prompt, temperature, top_p, top_k, repetition_penalty,
                           max_new_tokens, seed, current, request)

    @shown_to_user
    def edit_last(history: list, current: int, request: gr.Request) -> tuple[str, list[dict], str]:
        """The last message back in the textbox to edit and resend; it and its reply leave the chat."""
        before, message = last_turn(history)
        if current != NO_CONVERSATION:
            service.store.drop_last_turn(user_of(request), current)
        return message, before, "Editing your last message: change it and press Enter."

    @shown_to_user
    def export(history: list, system_prompt: str, kind: str) -> str:
        history = plain_messages(history)
        if not history:
            raise UserError("nothing to export yet: the conversation is empty")
        text = to_json(history, system_prompt) if kind == "json" else to_markdown(history, system_prompt)
        return write_download(text.encode(), "conversation-", f".{kind if kind == 'json' else 'md'}")

    with gr.Row():
        with gr.Column(scale=1, min_width=200):
            sidebar = Sidebar(CHAT, "chat", storage_secret)
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
            sampling = sampling_controls("chat")

    current = sidebar.current
    sidebar.wire(service, app, [chatbot, system_prompt],
                 lambda found: (history_of(found), found["system"] if found["system"] is not None else gr.skip()),
                 lambda: ([], gr.skip()), status)
    inputs = [message, chatbot, system_prompt, *sampling, current]
    outputs = [message, chatbot, status, current]
    # No concurrency limit: the engine batches every session's reply (and queues past its batch).
    for event in (message.submit(respond, inputs, outputs, api_visibility="private", concurrency_limit=None),
                  send.click(respond, inputs, outputs, api_visibility="private", concurrency_limit=None),
                  regen.click(regenerate, inputs[1:], outputs, api_visibility="private", concurrency_limit=None)):
        event.then(**sidebar.relist)
    edit.click(edit_last, [chatbot, current], [message, chatbot, status], api_visibility="private")
    preset.change(lambda name: PRESETS[name], preset, system_prompt, api_visibility="private")
    download_on_click(export_json, lambda h, s: export(h, s, "json"), [chatbot, system_prompt], "chat-export-json")
    download_on_click(export_md, lambda h, s: export(h, s, "md"), [chatbot, system_prompt], "chat-export-md")
    wire_stop(stop, service, CHAT, "stop")

    def chat(message: str, history: list[dict] | None = None, system_prompt: str = DEFAULT_SYSTEM,
             temperature: float = 0.7, top_p: float = 0.8, top_k: int = 20, repetition_penalty: float = 1.05,
             max_new_tokens: int = 512, seed: int = -1, request: gr.Request = None
             ) -> Iterator[tuple[str, list[dict], str]]:
        """API: stream a reply to `message` after `history` (a list of {role, content} with text content, or
        the Chatbot's own messages); yields (cleared textbox, history with the growing answer, status).
        Seed -1 = random. /stop stops this session's replies. Nothing is kept in the conversation store."""
        yield from shown_to_user(reply)(message, history, system_prompt, (temperature, top_p, top_k,
                                                                          repetition_penalty, max_new_tokens, seed),
                                        request, None)

    gr.api(chat, api_name="chat", concurrency_limit=None)
