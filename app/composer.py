"""The message box of a chat tab with one streaming control: Send, which becomes Stop (same place, same
size) while a reply streams. Escape stops it too (`page_style.HEAD`), and the box has the focus back
when the reply ends. The box stays the user's while a reply streams: Enter then keeps the message in it
and a line under it says why (`BUSY_HINT`); Send is off while the box is empty."""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from app.conversation import wire_stop
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool

STOP_CLASS = "studio-stop"  # what Escape clicks, when it is shown
COMPOSERS = ("chat", "image-chat")  # the element id prefixes of the page's composers (`page_style.HEAD`)
BUSY_HINT = "A reply is still coming: your message waits here. Press Enter once it ends, or Stop (Esc) to end it."


class Composer:
    """The box, Send and Stop of `tool`'s tab, made in the row being built; element ids start with `prefix`."""

    def __init__(self, tool: Tool, prefix: str, placeholder: str):
        self.tool, self.prefix = tool, prefix
        with gr.Row(equal_height=True):
            self.message = gr.Textbox(placeholder=placeholder, show_label=False, scale=6, elem_id=f"{prefix}-input")
            self.send = gr.Button("Send", variant="primary", scale=1, min_width=90, elem_id=f"{prefix}-send")
            self.stop = gr.Button("Stop", variant="stop", scale=1, min_width=90, visible=False,
                                  elem_id=f"{prefix}-stop", elem_classes=[STOP_CLASS])
        gr.HTML(f'<div id="{prefix}-hint" class="studio-hint" aria-live="polite"></div>', padding=False)  # BUSY_HINT

    def streams(self, triggers: list[Callable], fn: Callable, inputs: set | list, outputs: list) -> list:
        """Run `fn` on each of `triggers` (e.g. `message.submit`) with Send shown as Stop meanwhile; the
        events that end each run, to chain more on (they run however the reply ended)."""
        swap = dict(inputs=None, outputs=[self.send, self.stop], queue=False, api_visibility="private")
        busy = dict(fn=lambda: (gr.Button(visible=False), gr.Button(visible=True)), **swap)
        idle = dict(fn=lambda: (gr.Button(visible=True), gr.Button(visible=False)), **swap)
        focus = dict(fn=None, js=f"() => {{ document.querySelector('#{self.prefix}-input textarea')?.focus(); }}",
                     api_visibility="private")
        # No concurrency limit: the engine batches every session's reply (and queues past its batch).
        return [trigger(**busy).then(fn, inputs, outputs, api_visibility="private", concurrency_limit=None)
                .then(**idle).then(**focus) for trigger in triggers]

    def wire_stop(self, service: StudioService, api_name: str) -> None:
        wire_stop(self.stop, service, self.tool, api_name)
