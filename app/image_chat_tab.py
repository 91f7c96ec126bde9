"""The Image-chat tab: an image beside a streamed conversation about it (MiniGPT-4). Wiring only."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import gradio as gr
from gradio.data_classes import FileData

from app.conversation import SLIDERS, sampling_controls, stream_turn, wire_stop
from app.errors import shown_to_user
from pipeline.service.studio import IMAGE_CHAT, StudioService, plain_messages


@dataclasses.dataclass
class ImageChatTab:
    """What other tabs drive: put an image and a question here, then run `respond` (Segment's "Ask about this")."""

    image: gr.Image
    message: gr.Textbox
    respond: Callable
    inputs: list
    outputs: list


def build_image_chat_tab(service: StudioService, examples: list[str]) -> ImageChatTab:
    @shown_to_user
    def respond(image: str | None, message: str, history: list, temperature: float, top_p: float, top_k: int,
                repetition_penalty: float, max_new_tokens: int, seed: int, request: gr.Request):
        """Stream an answer about `image` (a file); yields (textbox, history, status). Seed -1 = random."""
        turn = service.chat_turn(plain_messages(history, "history") + [{"role": "user", "content": message}],
                                 dict(zip(SLIDERS, (temperature, top_p, top_k, repetition_penalty, max_new_tokens,
                                                    seed))), tool=IMAGE_CHAT, image=image)
        yield from stream_turn(service, turn, request)

    with gr.Row():
        with gr.Column(scale=2):
            image = gr.Image(label="Image (a new one starts a new conversation)", type="filepath", image_mode=None,
                             sources=["upload", "clipboard"], height=420, elem_id="image-chat-image")
            gr.Examples(examples, inputs=image)
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(label="Conversation about the image", height=420, buttons=["copy", "copy_all"])
            with gr.Row():
                message = gr.Textbox(placeholder="Ask about the image, Enter to send", show_label=False, scale=6)
                send = gr.Button("Send", variant="primary", scale=1)
            with gr.Row():
                stop = gr.Button("Stop")
                restart = gr.Button("Restart conversation")
            status = gr.Markdown("", elem_id="image-chat-status")
            sampling = sampling_controls("image-chat", max_new_tokens=300)

    inputs = [image, message, chatbot, *sampling]
    outputs = [message, chatbot, status]
    message.submit(respond, inputs, outputs, api_visibility="private", concurrency_limit=None)
    send.click(respond, inputs, outputs, api_visibility="private", concurrency_limit=None)
    wire_stop(stop, service, IMAGE_CHAT, "image_chat_stop")
    fresh = dict(fn=lambda: ([], ""), inputs=None, outputs=[chatbot, status], api_visibility="private")
    restart.click(**fresh)
    image.change(**fresh)

    def image_chat(image: FileData | None, message: str, history: list[dict], temperature: float = 0.7,
                   top_p: float = 0.8, top_k: int = 20, repetition_penalty: float = 1.05, max_new_tokens: int = 300,
                   seed: int = -1, request: gr.Request = None) -> Iterator[tuple[list[dict], str]]:
        """API: stream an answer about `image` to `message` after `history` (a list of {role, content});
        yields (history with the growing answer, status). Any file may be sent: what is not a usable
        image gets a clear message. /image_chat_stop stops this session's answer."""
        path = image["path"] if isinstance(image, dict) else image.path if image is not None else None
        for _, new_history, line in respond(path, message, history, temperature, top_p, top_k, repetition_penalty,
                                            max_new_tokens, seed, request):
            yield new_history, line

    gr.api(image_chat, api_name="image_chat", concurrency_limit=None)
    return ImageChatTab(image, message, respond, inputs, outputs)
