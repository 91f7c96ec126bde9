"""The Chat tab: wiring between Gradio components and the studio service (no request rules here)."""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from app.composer import Composer, reply_menu
from app.page_style import CHAT_PANE_CLASS, CHAT_PANE_HEIGHT, LATEX
from app.conversation import client_of, continuable, turn, user_of
from app.conversation_files import to_json, to_markdown
from app.downloads import download_on_click, write_download
from app.errors import shown_to_user
from app.sampling_form import SamplingForm
from app.sidebar import NO_CONVERSATION, Sidebar, history_of
from app.versions import neighbour, shown, switcher_label, switcher_target
from pipeline.errors import UserError
from pipeline.service.messages import plain_messages
from pipeline.service.requests import Revision, Saved
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
GREETING = "**What can I help with?** Ask anything, or start from one of these:"
EXAMPLE_PROMPTS = ("Explain what a large language model is to a ten-year-old.",
                   "Write a Python function that tells whether a word is a palindrome.",
                   "Give me three ideas for a rainy weekend.")
NO_DOCUMENTS = "None: the model alone"
EDITING = "Editing your last message: Enter sends it as a new version (the old one stays); Cancel edit keeps it."


def build_chat_tab(service: StudioService, app: gr.Blocks, storage_secret: str) -> None:
    """`storage_secret` encrypts which conversation is open, kept in the browser's localStorage so a
    reload reopens it (the conversations themselves are in the store)."""
    store = service.store

    def saved(current: int, request: gr.Request, revision: Revision = Revision.NEW) -> Saved:
        return Saved(user_of(request), None if current == NO_CONVERSATION else current, revision)

    def reply(updates, data: dict, request: gr.Request, clear: bool = True):
        """A reply's outputs, with editing over (its state cleared, Cancel edit hidden), then Continue."""
        yield from turn(updates, data[current], (sidebar.viewing, request.session_hash), clear,
                        during=(None, gr.Button(visible=False)), on_page=data[chatbot])

    @shown_to_user
    def respond(data: dict, request: gr.Request, fed: Callable):
        """Stream a reply to the message, kept in the open conversation (a new one if none is open); an
        edited last message is kept as another version of it."""
        revision = Revision.QUESTION if data[editing] is not None else Revision.NEW
        updates = service.send(client_of(request), data[chatbot], data[message], form.values(data),
                               system=data[system_prompt], saved=saved(data[current], request, revision),
                               collection=data[documents] or None)
        yield from reply(fed(updates), data, request)

    def redo(action: Callable) -> Callable:
        """`action` (the service's regenerate or continue_reply) on the last reply, kept as another version
        of it; a draft in the box stays."""
        @shown_to_user
        def run(data: dict, request: gr.Request, fed: Callable):
            if data[editing] is not None:
                raise UserError("send or cancel the edit first")
            updates = action(client_of(request), data[chatbot], form.values(data), system=data[system_prompt],
                             saved=saved(data[current], request), collection=data[documents] or None)
            yield from reply(fed(updates), data, request, clear=False)
        return run

    regenerate = redo(service.regenerate)  # another draw (the same one if the seed is fixed)
    continue_reply = redo(service.continue_reply)  # cut at the token limit or stopped: goes on in the same message

    @shown_to_user
    def edit_last(history: list, before_edit: list | None) -> tuple:
        """The last message back in the textbox to change; it and its reply leave the view until Send
        (a new version) or Cancel edit (as it was)."""
        before, last = service.edit_last(history)
        return last, before, EDITING, before_edit if before_edit is not None else history, gr.Button(visible=True)

    def cancel_edit(before_edit: list | None) -> tuple:
        return "", before_edit if before_edit is not None else gr.skip(), "Edit cancelled.", None, \
            gr.Button(visible=False)

    def switcher_view(messages: list[dict], wanted: int | None) -> tuple:
        """The switcher (shown or not, its label, the message it is about) for `wanted`, or the last exchange."""
        target = switcher_target(messages, wanted)
        return gr.Row(visible=target is not None), switcher_label(target) if target else "", \
            target["id"] if target else None

    def versions_of(conversation: int, wanted: int | None, request: gr.Request) -> tuple:
        messages = [] if conversation == NO_CONVERSATION else store.open(user_of(request), conversation)["messages"]
        return switcher_view(messages, wanted)

    def stepping(step: int) -> Callable:
        @shown_to_user
        def step_version(conversation: int, wanted: int | None, request: gr.Request) -> tuple:
            """The version `step` away of the message the switcher is about, shown with its branch."""
            user = user_of(request)
            target = switcher_target(store.open(user, conversation)["messages"], wanted) \
                if conversation != NO_CONVERSATION else None
            other = neighbour(target, step) if target is not None else None
            if other is None:
                raise UserError("there is no " + ("older" if step < 0 else "newer") + " version")
            store.choose(user, conversation, other)
            return history_of(store.open(user, conversation)), *versions_of(conversation, other, request)
        return step_version

    def pick(conversation: int, evt: gr.SelectData, request: gr.Request) -> tuple:
        """A message clicked: the switcher offers its versions, if it has others."""
        index = evt.index if isinstance(evt.index, int) else evt.index[0]
        visible = [] if conversation == NO_CONVERSATION else shown(store.open(user_of(request), conversation)["messages"])
        return versions_of(conversation, visible[index]["id"] if index < len(visible) else None, request)

    def collections(chosen: str | None = None) -> gr.Dropdown:
        """The picker's choices now (collections come and go in the Documents tab)."""
        names = service.documents.names() if service.documents is not None else []
        chosen_now = {} if chosen is None else {"value": chosen if chosen in names else ""}  # None: as it is
        return gr.Dropdown(choices=[(NO_DOCUMENTS, "")] + [(n, n) for n in names], **chosen_now)

    @shown_to_user
    def pick_collection(name: str, conversation: int, request: gr.Request) -> str:
        """The open conversation answers from `name` from now on; the collection is brought up to date."""
        if conversation != NO_CONVERSATION:
            store.set_collection(user_of(request), conversation, name or None)
        if name:
            service.documents.refresh(name)
        return f"Answers come from the collection “{name}”, with its sources under each reply." if name else \
            "Answers come from the model alone."

    def example(evt: gr.SelectData) -> str:
        return evt.value["text"]

    def export(history: list, system_prompt: str, kind: str) -> str:
        history = plain_messages(history)
        if not history:
            raise UserError("nothing to export yet: the conversation is empty")
        text = to_json(history, system_prompt) if kind == "json" else to_markdown(history, system_prompt)
        return write_download(text.encode(), "conversation-", f".{kind if kind == 'json' else 'md'}")

    with gr.Row():
        sidebar = Sidebar(Tool.CHAT, "chat", storage_secret)
        with gr.Column(scale=4):
            chatbot = gr.Chatbot(label="Chat", height=CHAT_PANE_HEIGHT, buttons=["copy", "copy_all"], elem_id="chat-history",
                                 latex_delimiters=LATEX, elem_classes=[CHAT_PANE_CLASS],
                                 feedback_options=reply_menu(service.speech), placeholder=GREETING,
                                 examples=[{"text": p} for p in EXAMPLE_PROMPTS])
            with gr.Row(visible=False, elem_id="chat-versions", equal_height=True) as switcher:
                older = gr.Button("‹ older", size="sm", min_width=70, elem_id="chat-version-older")
                label = gr.Markdown("", elem_id="chat-version-label")
                newer = gr.Button("newer ›", size="sm", min_width=70, elem_id="chat-version-newer")
            composer = Composer(Tool.CHAT, "chat", "Type a message, Enter to send", service.speech)
            message = composer.message
            status = gr.Markdown("", elem_id="chat-status")  # right under the message box: in view on a laptop
            with gr.Row():  # one row at a laptop's width
                regen = gr.Button("Regenerate", size="sm", min_width=90, elem_id="chat-regenerate")
                more = gr.Button("Continue", size="sm", visible=False, min_width=90, elem_id="chat-continue")
                edit = gr.Button("Edit last", size="sm", min_width=90, elem_id="chat-edit")
                cancel = gr.Button("Cancel edit", size="sm", visible=False, min_width=90, elem_id="chat-cancel-edit")
                export_json = gr.Button("Export JSON", size="sm", min_width=90)
                export_md = gr.Button("Export Markdown", size="sm", min_width=90)
            composer.voice_controls()
        with gr.Column(scale=2, min_width=240):
            documents = gr.Dropdown([(NO_DOCUMENTS, "")], value="", label="Answer from documents",
                                    visible=service.documents is not None, elem_id="chat-collection",
                                    info="a collection of the Documents tab: answers cite its passages")
            preset = gr.Dropdown(list(PRESETS), value="Helpful assistant", label="System prompt preset",
                                 elem_id="chat-preset")
            system_prompt = gr.Textbox(DEFAULT_SYSTEM, label="System prompt", lines=3, elem_id="chat-system")
            form = SamplingForm("chat")
    editing = gr.State(None)  # while editing: the conversation as shown before, for Cancel edit
    target = gr.State(None)  # the message whose versions the switcher offers (None: the last exchange's)

    current = sidebar.current
    sidebar.wire(service, app, [chatbot, system_prompt, switcher, label, target, more, documents],
                 lambda found: (history_of(found), found["system"] if found["system"] is not None else gr.skip(),
                                *switcher_view(found["messages"], None), gr.Button(visible=continuable(found)),
                                collections(found["collection"] or "")),
                 lambda: ([], gr.skip(), gr.Row(visible=False), "", None, gr.Button(visible=False), gr.skip()), status)
    inputs = {message, chatbot, system_prompt, current, editing, documents, *form.components}
    outputs = [message, chatbot, status, current, editing, cancel, more]
    private = dict(api_visibility="private")
    versions = dict(fn=versions_of, inputs=[current, target], outputs=[switcher, label, target], **private)
    for ended in [*composer.streams([message.submit, composer.send.click], respond, inputs, outputs),
                  *composer.streams([regen.click], regenerate, inputs, outputs),
                  *composer.streams([more.click], continue_reply, inputs, outputs)]:
        ended.then(**sidebar.relist).then(**versions)
    composer.wire_stop(service, "stop")
    composer.wire_reading(chatbot)
    edit.click(edit_last, [chatbot, editing], [message, chatbot, status, editing, cancel], **private)
    cancel.click(cancel_edit, editing, [message, chatbot, status, editing, cancel], **private)
    for button, step in ((older, -1), (newer, 1)):
        button.click(stepping(step), [current, target], [chatbot, switcher, label, target],
                     **private).then(**sidebar.relist)
    chatbot.select(pick, current, [switcher, label, target], **private)
    chatbot.example_select(example, None, message, **private)
    preset.change(lambda name: PRESETS[name], preset, system_prompt, **private)
    for listed in (app.load, documents.focus):
        listed(collections, None, documents, **private)
    documents.input(pick_collection, [documents, current], status, **private)
    download_on_click(export_json, lambda h, s: export(h, s, "json"), [chatbot, system_prompt], "chat-export-json")
    download_on_click(export_md, lambda h, s: export(h, s, "md"), [chatbot, system_prompt], "chat-export-md")
