"""The Image-chat tab: an image beside a streamed conversation about it (MiniGPT-4). Wiring only."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gradio as gr

from app.conversation import client_of, streamed, user_of, wire_stop
from app.errors import shown_to_user
from app.sampling_form import SamplingForm
from app.sidebar import NO_CONVERSATION, Sidebar, history_of, image_file
from pipeline.service.requests import Saved
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool

IMAGE_CHAT_MAX_NEW_TOKENS = 300  # answers about a picture are short: the tab's default, and its API's


@dataclasses.dataclass
class ImageChatTab:
    """What other tabs drive: put an image and a question here, then run `respond` (Segment's "Ask about this")."""

    image: gr.Image
    message: gr.Textbox
    respond: Callable
    inputs: set
    outputs: list
    fresh: list  # what a new picture resets: the conversation shown and which one is open


def build_image_chat_tab(service: StudioService, page: gr.Blocks, examples: list[str],
                         storage_secret: str) -> ImageChatTab:
    @shown_to_user
    def respond(data: dict, request: gr.Request):
        """Stream an answer about the image, kept in the open conversation (a new one holding the picture
        if none is open); yields (textbox, history, status, conversation)."""
        current = data[sidebar.current]
        saved = Saved(user_of(request), None if current == NO_CONVERSATION else current)
        updates = service.send(client_of(request), data[chatbot], data[message], form.values(data),
                               tool=Tool.IMAGE_CHAT, image=data[image], saved=saved)
        yield from streamed(updates, current)

    with gr.Row():
        with gr.Column(scale=1, min_width=200):
            sidebar = Sidebar(Tool.IMAGE_CHAT, "image-chat", storage_secret)
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
            form = SamplingForm("image-chat", max_new_tokens=IMAGE_CHAT_MAX_NEW_TOKENS)

    current = sidebar.current
    sidebar.wire(service, page, [chatbot, image],
                 lambda found: (history_of(found), image_file(found["image_data"]) if found["image_data"] else None),
                 lambda: ([], None), status)
    inputs = {image, message, chatbot, current, *form.components}
    outputs = [message, chatbot, status, current]
    for event in (message.submit(respond, inputs, outputs, api_visibility="private", concurrency_limit=None),
                  send.click(respond, inputs, outputs, api_visibility="private", concurrency_limit=None)):
        event.then(**sidebar.relist)
    wire_stop(stop, service, Tool.IMAGE_CHAT, "image_chat_stop")
    # A new picture, or Restart, starts a new conversation (the old one stays in the sidebar). Only the
    # user's own changes count: opening a stored conversation sets the picture too.
    fresh = dict(fn=lambda: ([], "", NO_CONVERSATION), inputs=None, outputs=[chatbot, status, current],
                 api_visibility="private")
    for event in (restart.click(**fresh), image.upload(**fresh), image.clear(**fresh),
                  samples.load_input_event.then(**fresh)):
        event.then(**sidebar.relist)

    return ImageChatTab(image, message, respond, inputs, outputs, [chatbot, current])
