"""The Image-chat tab: an image beside a streamed conversation about it (MiniGPT-4). Wiring only."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import gradio as gr
from gradio.data_classes import FileData

from app.conversation import SLIDERS, sampling_controls, stream_turn, user_of, wire_stop
from app.errors import shown_to_user
from app.sidebar import NO_CONVERSATION, Sidebar, history_of, image_file
from pipeline.service.studio import IMAGE_CHAT, Saved, StudioService, plain_messages


@dataclasses.dataclass
class ImageChatTab:
    """What other tabs drive: put an image and a question here, then run `respond` (Segment's "Ask about this")."""

    image: gr.Image
    message: gr.Textbox
    respond: Callable
    inputs: list
    outputs: list
    fresh: list  # what a new picture resets: the conversation shown and which one is open


def build_image_chat_tab(service: StudioService, page: gr.Blocks, examples: list[str],
                         storage_secret: str) -> ImageChatTab:
    def reply(image: str | None, message: str, history: list, sampling: tuple, request: gr.Request,
              current: int, keep: bool = True) -> Iterator[tuple]:
        """(textbox, history, status, conversation) as the answer streams; with `keep`, kept in `current`
        (a new conversation holding the picture if none is open)."""
        turn = service.chat_turn(plain_messages(history, "history") + [{"role": "user", "content": message}],
                                 dict(zip(SLIDERS, sampling)), tool=IMAGE_CHAT, image=image)
        saved = None
        if keep:
            user = user_of(request)
            if current == NO_CONVERSATION:
                current = service.store.create(user, IMAGE_CHAT, image=Path(image).read_bytes())
            saved = Saved(user, current)
        for out in stream_turn(service, turn, request, saved):
            yield *out, current

    @shown_to_user
    def respond(image: str | None, message: str, history: list, temperature: float, top_p: float, top_k: int,
                repetition_penalty: float, max_new_tokens: int, seed: int, current: int,
                request: gr.Request):
        """Stream an answer about `image` (a file), kept in the conversation `current`; yields (textbox,
        history, status, conversation). Seed -1 = random."""
        yield from reply(image, message, history, (temperature, top_p, top_k, repetition_penalty, max_new_tokens,
                                                   seed), request, current)

    with gr.Row():
        with gr.Column(scale=1, min_width=200):
            sidebar = Sidebar(IMAGE_CHAT, "image-chat", storage_secret)
        with gr.Column(scale=2):
            image = gr.Image(label="Image (a new one starts a new conversation)", type="filepath", image_mode=None,
                             sources=["upload", "clipboard"], height=420, elem_id="image-chat-image")
            samples = gr.Examples(examples, inputs=image)
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(label="Conversation about the image", height=420, buttons=["copy", "copy_all"],
                                 elem_id="image-chat-history")
            with gr.Row():
                message = gr.Textbox(placeholder="Ask about the image, Enter to send", show_label=False, scale=6)
                send = gr.Button("Send", variant="primary", scale=1)
            with gr.Row():
                stop = gr.Button("Stop")
                restart = gr.Button("Restart conversation")
            status = gr.Markdown("", elem_id="image-chat-status")
            sampling = sampling_controls("image-chat", max_new_tokens=300)

    current = sidebar.current
    sidebar.wire(service, page, [chatbot, image],
                 lambda found: (history_of(found), image_file(found["image_data"]) if found["image_data"] else None),
                 lambda: ([], None), status)
    inputs = [image, message, chatbot, *sampling, current]
    outputs = [message, chatbot, status, current]
    for event in (message.submit(respond, inputs, outputs, api_visibility="private", concurrency_limit=None),
                  send.click(respond, inputs, outputs, api_visibility="private", concurrency_limit=None)):
        event.then(**sidebar.relist)
    wire_stop(stop, service, IMAGE_CHAT, "image_chat_stop")
    # A new picture, or Restart, starts a new conversation (the old one stays in the sidebar). Only the
    # user's own changes count: opening a stored conversation sets the picture too.
    fresh = dict(fn=lambda: ([], "", NO_CONVERSATION), inputs=None, outputs=[chatbot, status, current],
                 api_visibility="private")
    for event in (restart.click(**fresh), image.upload(**fresh), image.clear(**fresh),
                  samples.load_input_event.then(**fresh)):
        event.then(**sidebar.relist)

    def image_chat(image: FileData | None, message: str, history: list[dict], temperature: float = 0.7,
                   top_p: float = 0.8, top_k: int = 20, repetition_penalty: float = 1.05, max_new_tokens: int = 300,
                   seed: int = -1, request: gr.Request = None) -> Iterator[tuple[list[dict], str]]:
        """API: stream an answer about `image` to `message` after `history` (a list of {role, content});
        yields (history with the growing answer, status). Any file may be sent: what is not a usable
        image gets a clear message. /image_chat_stop stops this session's answer."""
        path = image["path"] if isinstance(image, dict) else image.path if image is not None else None
        for _, new_history, line, _ in shown_to_user(reply)(path, message, history, (
                temperature, top_p, top_k, repetition_penalty, max_new_tokens, seed), request, NO_CONVERSATION,
                keep=False):
            yield new_history, line

    gr.api(image_chat, api_name="image_chat", concurrency_limit=None)
    return ImageChatTab(image, message, respond, inputs, outputs, [chatbot, current])
