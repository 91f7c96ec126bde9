"""The message box of a chat tab with one streaming control: Send, which becomes Stop (same place, same
size) while a reply streams. Escape stops it too (`page_style.HEAD`), and the box has the focus back
when the reply ends. The box stays the user's while a reply streams: Enter then keeps the message in it
and a line under it says why (`BUSY_HINT`); Send is off while the box is empty.

Under the tab's actions and status line (`voice_controls`), where the app has speech: a microphone (what is said
lands in the box, to read and edit), a "Read replies aloud" switch and the speaker that plays them (`read_aloud.py`),
sentence by sentence as they stream, and voice mode (`voice_mode.js`); each reply's menu reads that reply aloud.
Stop ends the speech too."""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from app.conversation import wire_stop
from app.errors import shown_to_user
from app.read_aloud import QUIET, read_aloud, read_message
from pipeline.errors import UserError
from pipeline.service.messages import SOURCES_START, text_of
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool
from pipeline.speech.speech import Speech

STOP_CLASS = "studio-stop"  # what Escape clicks, when it is shown
COMPOSERS = ("chat", "image-chat")  # the element id prefixes of the page's composers (`page_style.HEAD`)
READ_ALOUD = "Read aloud"
BUSY_HINT = "A reply is still coming: your message waits here. Press Enter once it ends, or Stop (Esc) to end it."


def reply_menu(speech: Speech) -> tuple[str, ...]:
    """A chat pane's menu on each reply (its `feedback_options`): "Read aloud", where the app has a voice."""
    return (READ_ALOUD,) if speech.voice is not None else ()


class Composer:
    """The box, Send and Stop of `tool`'s tab, made in the row being built; element ids start with `prefix`."""

    def __init__(self, tool: Tool, prefix: str, placeholder: str, speech: Speech):
        self.tool, self.prefix, self.speech = tool, prefix, speech
        with gr.Row(equal_height=True):
            self.message = gr.Textbox(placeholder=placeholder, show_label=False, scale=6, elem_id=f"{prefix}-input")
            self.send = gr.Button("Send", variant="primary", scale=1, min_width=90, elem_id=f"{prefix}-send")
            self.stop = gr.Button("Stop", variant="stop", scale=1, min_width=90, visible=False,
                                  elem_id=f"{prefix}-stop", elem_classes=[STOP_CLASS])
        gr.HTML(f'<div id="{prefix}-hint" class="studio-hint" aria-live="polite"></div>', padding=False)  # BUSY_HINT

    def voice_controls(self) -> None:
        """The microphone, the read-aloud switches and the speaker, made in the column being built (the tab puts them
        under its own actions and status line, which stay next to the box)."""
        speech, prefix = self.speech, self.prefix
        with gr.Row(equal_height=True, visible=speech.ears is not None or speech.voice is not None):
            with gr.Column(scale=3, visible=speech.ears is not None):
                self.mic = gr.Audio(sources=["microphone", "upload"], type="filepath",
                                    label="Speak your message (or drop a recording)", elem_id=f"{prefix}-mic")
                gr.HTML(f'<div id="{prefix}-mic-help" class="studio-hint" aria-live="polite"></div>', padding=False)
            with gr.Column(scale=2, visible=speech.voice is not None):
                with gr.Row():
                    self.aloud = gr.Checkbox(False, label="Read replies aloud", elem_id=f"{prefix}-aloud")
                    self.voice = gr.Checkbox(False, label="Voice mode (hands-free)", elem_id=f"{prefix}-voice",
                                             visible=speech.ears is not None,
                                             info="talk, hear the answer, talk again; speak to interrupt")
                self.speaker = gr.HTML(QUIET, elem_id=f"{prefix}-speaker", padding=False)
        for recorded in (self.mic.stop_recording, self.mic.upload):  # in voice mode, `voice_mode.js` sends the words
            recorded(self.heard, [self.mic, self.message], [self.message, self.mic], api_visibility="private",
                     concurrency_limit=None)
        self.voice.change(lambda on: True if on else gr.skip(), self.voice, self.aloud, api_visibility="private")

    def heard(self, recording: str | None, draft: str, progress=gr.Progress()) -> tuple:
        """A recording's words after the draft in the box (to read and edit before sending); the recorder cleared. A
        long one shows how far its transcription is."""
        if not recording:
            return gr.skip(), gr.skip()

        def done(seconds: float, total: float) -> None:
            progress(seconds / total, desc=f"Transcribing: {seconds / 60:.0f} of {total / 60:.0f} minutes")
        try:
            said = self.speech.transcribe(recording, progress=done).text
        except UserError as e:
            gr.Warning(str(e)[:1].upper() + str(e)[1:])
            return gr.skip(), None
        return f"{draft.rstrip()} {said}".strip(), None

    def streams(self, triggers: list[Callable], fn: Callable, inputs: set, outputs: list) -> list:
        """Run `fn(data, request, fed)` on each of `triggers` (e.g. `message.submit`) with Send shown as Stop
        meanwhile, its reply's updates passed through `fed` (which reads them aloud when asked, the speaker shown
        with the first); the events that end each run, to chain more on (they run however the reply ended)."""
        swap = dict(inputs=None, outputs=[self.send, self.stop], queue=False, api_visibility="private")
        busy = dict(fn=lambda: (gr.Button(visible=False), gr.Button(visible=True)), **swap)
        idle = dict(fn=lambda: (gr.Button(visible=True), gr.Button(visible=False)), **swap)
        focus = dict(fn=None, js=f"() => {{ document.querySelector('#{self.prefix}-input textarea')?.focus(); }}",
                     api_visibility="private")

        def spoken(data: dict, request: gr.Request):
            with read_aloud(self.speech, request.session_hash, bool(data[self.aloud]), self.prefix) as (fed, shown):
                for i, out in enumerate(fn(data, request, fed)):
                    if not isinstance(out, tuple):  # a refusal's one skip for every output (`errors._toast`)
                        yield out
                        continue
                    yield *out, shown if i == 0 and shown is not None else gr.skip()

        # No concurrency limit: the engine batches every session's reply (and queues past its batch).
        return [trigger(**busy).then(spoken, {*inputs, self.aloud}, [*outputs, self.speaker], api_visibility="private",
                                     concurrency_limit=None).then(**idle).then(**focus) for trigger in triggers]

    def wire_stop(self, service: StudioService, api_name: str) -> None:
        wire_stop(self.stop, service, self.tool, api_name)

        def silence(request: gr.Request) -> None:
            self.speech.stop_reading(request.session_hash)
        self.stop.click(silence, None, None, api_visibility="private")

    def wire_reading(self, chatbot: gr.Chatbot) -> None:
        """A reply's "Read aloud" (its menu in `chatbot`) plays it on the speaker."""
        @shown_to_user
        def read(history: list, evt: gr.LikeData, request: gr.Request) -> str:
            if evt.liked != READ_ALOUD or not isinstance(evt.index, int) or evt.index >= len(history):
                return gr.skip()
            text = text_of(history[evt.index].get("content")).split(SOURCES_START)[0]
            return read_message(self.speech, request.session_hash, text, self.prefix)

        chatbot.like(read, chatbot, self.speaker, api_visibility="private", concurrency_limit=None)
