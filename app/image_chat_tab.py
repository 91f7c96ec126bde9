"""The Image-chat tab: an image beside a streamed conversation about it (MiniGPT-4). Wiring only."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gradio as gr

from app.composer import Composer, reply_menu
from app.conversation import Shown, client_of, continuable, turn, user_of
from app.errors import shown_to_user
from app.page_style import CHAT_PANE_CLASS, LATEX
from app.sampling_form import SamplingForm
from app.sidebar import NO_CONVERSATION, Sidebar, history_of, image_file
from pipeline.service.requests import Saved
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool

IMAGE_CHAT_MAX_NEW_TOKENS = 300  # answers about a picture are short: the tab's default, and its API's


@dataclasses.dataclass
class ImageChatTab:
    """What other tabs drive (Segment's "Ask about this"): `show(picture, question)` gives `outputs`' values
    for a new conversation about `picture`; `ask(picture, question, data, request)` then answers it,
    streaming into `outputs`, with the sampling settings read from `data` (it holds `inputs`); `relist`
    refreshes the sidebar after."""

    composer: Composer
    show: Callable
    ask: Callable
    inputs: set
    outputs: list
    relist: dict


def build_image_chat_tab(service: StudioService, page: gr.Blocks, examples: list[str],
                         storage_secret: str) -> ImageChatTab:
    def saved(current: int, request: gr.Request) -> Saved:
        return Saved(user_of(request), None if current == NO_CONVERSATION else current)

    @shown_to_user
    def respond(data: dict, request: gr.Request, fed: Callable):
        """Stream an answer about the image, kept in the open conversation (a new one holding the picture
        if none is open); yields (textbox, history, status, conversation, Continue)."""
        current = data[sidebar.current]
        updates = service.send(client_of(request), data[chatbot], data[message], form.values(data),
                               tool=Tool.IMAGE_CHAT, image=data[image], saved=saved(current, request))
        yield from turn(fed(updates), current, (sidebar.viewing, request.session_hash))

    @shown_to_user
    def continue_reply(data: dict, request: gr.Request, fed: Callable):
        """The last answer, cut at the token limit or stopped, goes on in the same message (a draft in the
        box stays)."""
        current = data[sidebar.current]
        updates = service.continue_reply(client_of(request), data[chatbot], form.values(data),
                                         tool=Tool.IMAGE_CHAT, image=data[image], saved=saved(current, request))
        yield from turn(fed(updates), current, (sidebar.viewing, request.session_hash), clear=False)

    def show(picture: str, question: str) -> tuple:
        return picture, question, [], "", NO_CONVERSATION, gr.Button(visible=False)

    def ask(picture: str, question: str, data: dict, request: gr.Request, fed: Callable):
        """`question` about `picture` answered, in a new conversation (the one this page shows now)."""
        sidebar.viewing.show(request.session_hash, Shown(NO_CONVERSATION))
        updates = service.send(client_of(request), [], question, form.values(data), tool=Tool.IMAGE_CHAT,
                               image=picture, saved=Saved(user_of(request)))
        for shown_now in turn(fed(updates), NO_CONVERSATION, (sidebar.viewing, request.session_hash)):
            yield gr.skip(), *shown_now

    with gr.Row():
        sidebar = Sidebar(Tool.IMAGE_CHAT, "image-chat", storage_secret)
        with gr.Column(scale=2):
            image = gr.Image(label="Image (a new one starts a new conversation)", type="filepath", image_mode=None,
                             sources=["upload", "clipboard"], height=420, elem_id="image-chat-image")
            samples = gr.Examples(examples, inputs=image)
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(label="Conversation about the image", height=420, buttons=["copy", "copy_all"],
                                 latex_delimiters=LATEX, elem_classes=[CHAT_PANE_CLASS],
                                 feedback_options=reply_menu(service.speech), elem_id="image-chat-history")
            composer = Composer(Tool.IMAGE_CHAT, "image-chat", "Ask about the image, Enter to send", service.speech)
            message = composer.message
            status = gr.Markdown("", elem_id="image-chat-status")  # right under the message box, as in Chat
            with gr.Row():
                more = gr.Button("Continue", size="sm", visible=False, elem_id="image-chat-continue")
                restart = gr.Button("Restart conversation", size="sm")
            composer.voice_controls()
            form = SamplingForm("image-chat", max_new_tokens=IMAGE_CHAT_MAX_NEW_TOKENS)

    current = sidebar.current
    sidebar.wire(service, page, [chatbot, image, more],
                 lambda found: (history_of(found), image_file(found["image_data"]) if found["image_data"] else None,
                                gr.Button(visible=continuable(found))),
                 lambda: ([], None, gr.Button(visible=False)), status)
    inputs = {image, message, chatbot, current, *form.components}
    outputs = [message, chatbot, status, current, more]
    for ended in [*composer.streams([message.submit, composer.send.click], respond, inputs, outputs),
                  *composer.streams([more.click], continue_reply, inputs, outputs)]:
        ended.then(**sidebar.relist)
    composer.wire_stop(service, "image_chat_stop")
    composer.wire_reading(chatbot)
    # A new picture, or Restart, starts a new conversation (the old one stays in the sidebar). Only the
    # user's own changes count: opening a stored conversation sets the picture too.
    fresh = dict(fn=lambda: ([], "", NO_CONVERSATION, gr.Button(visible=False)), inputs=None,
                 outputs=[chatbot, status, current, more], api_visibility="private")
    for event in (restart.click(**fresh), image.upload(**fresh), image.clear(**fresh),
                  samples.load_input_event.then(**fresh)):
        event.then(**sidebar.relist)

    return ImageChatTab(composer, show, ask, set(form.components), [image, *outputs], sidebar.relist)
