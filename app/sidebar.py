"""The conversation sidebar of the Chat and Image-chat tabs: the user's conversations from the store,
newest first, with new, open, rename, delete, search, export and import. Wiring only: the store's
queries decide whose conversations these are, so a forged id opens nothing."""

from __future__ import annotations

import datetime
import io
import time
from collections.abc import Callable
from pathlib import Path

import gradio as gr
from PIL import Image

from app.conversation import NO_CONVERSATION, Shown, Viewing, continuable, user_of
from app.conversation_files import read_conversations, to_archive
from app.downloads import download_on_click, write_download
from app.errors import shown_to_user
from app.sources_view import sources_markdown
from pipeline.errors import UserError
from pipeline.service.messages import INTERRUPTED
from pipeline.service.store import UNDO_S
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool

NEW_TITLE = "New conversation"
SIDEBAR_CLASS, TOGGLE_CLASS = "studio-sidebar", "studio-sidebar-toggle"  # a phone shows the list behind a button
ACTIONS_CLASS, LIST_CLASS = "studio-conversation-actions", "studio-conversation-list"
TOGGLE_JS = f"() => document.querySelectorAll('.{SIDEBAR_CLASS}').forEach(e => e.classList.toggle('open'))"
# On a phone, choosing a conversation folds the list away again, so the chat it opened is what shows.
FOLD_JS = f"() => document.querySelectorAll('.{SIDEBAR_CLASS}').forEach(e => e.classList.remove('open'))"


def ago(then: float, now: float) -> str:
    """When something happened, as people say it: "just now", "5 min ago", "3 h ago", "yesterday",
    "4 days ago", then the date."""
    seconds, days = now - then, (datetime.date.fromtimestamp(now) - datetime.date.fromtimestamp(then)).days
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if days < 1:
        return f"{int(seconds // 3600)} h ago"
    if days < 7:
        return "yesterday" if days == 1 else f"{days} days ago"
    date = datetime.date.fromtimestamp(then)
    return f"{date:%b} {date.day}" + (f", {date.year}" if date.year != datetime.date.fromtimestamp(now).year else "")


def listed(conversation: dict, now: float) -> str:
    """A conversation's line in the list: its title and when it last changed."""
    return f"{conversation['title'] or NEW_TITLE} · {ago(conversation['updated'], now)}"


def history_of(found: dict) -> list[dict]:
    """A stored conversation's messages as the Chatbot shows them (a reply a crash cut, marked so)."""
    return [{"role": m["role"], "content": m["content"] + (INTERRUPTED if m["state"] == "interrupted" else "") +
             sources_markdown(m.get("sources"))} for m in found["messages"] if m["role"] != "system"]


def image_file(data: bytes) -> str:
    """A stored picture as a file the page can show, named with its format's extension."""
    try:
        kind = (Image.open(io.BytesIO(data)).format or "png").lower()
    except Exception:  # noqa: BLE001 - shown as stored; the image chat will say what is wrong with it
        kind = "bin"
    return write_download(data, "conversation-image-", f".{kind}")


def needs_one(conversation: int | None, action: str) -> None:
    """A `UserError` when no conversation is open for `action` to act on."""
    if conversation == NO_CONVERSATION:
        raise UserError(f"open a conversation first, then {action} it")


class Sidebar:
    """The sidebar's components (`current`: the open conversation's id, kept in the browser), made in
    the column being built, then wired once the tab's own components exist."""

    def __init__(self, tool: Tool, prefix: str, secret: str):
        """`tool`'s sidebar, a column of the row being built (behind a button on a phone); element ids
        start with `prefix`."""
        self.tool, self.prefix = tool, prefix
        self.toggle = gr.Button("☰ Conversations", size="sm", elem_classes=[TOGGLE_CLASS],
                                elem_id=f"{prefix}-sidebar-toggle")
        with gr.Column(scale=1, min_width=200, elem_classes=[SIDEBAR_CLASS], elem_id=f"{prefix}-sidebar"):
            self.new = gr.Button("New chat" if tool == Tool.CHAT else "New conversation", variant="secondary")
            # the open conversation's actions above the list, in view however long it is (shown only while
            # one is open: `page_style`), then the list
            with gr.Group(elem_classes=[ACTIONS_CLASS]):
                self.title = gr.Textbox(label="Title (Enter renames)", elem_id=f"{prefix}-title")
                with gr.Row():
                    self.rename = gr.Button("Rename", size="sm", elem_id=f"{prefix}-rename")
                    self.delete = gr.Button("Delete", size="sm", variant="stop", elem_id=f"{prefix}-delete")
                    self.export_one = gr.Button("Export", size="sm", elem_id=f"{prefix}-export-this")
            self.undo = gr.Button("Undo delete", size="sm", visible=False, elem_id=f"{prefix}-undo")
            self.search = gr.Textbox(placeholder="Search conversations", show_label=False, elem_id=f"{prefix}-search")
            self.conversations = gr.Radio([], label="Conversations", elem_id=f"{prefix}-conversations",
                                          elem_classes=[LIST_CLASS])
            with gr.Row():
                self.export_all = gr.Button("Export all", size="sm")
                self.importer = gr.UploadButton("Import conversation", file_types=[".json", ".md"], size="sm",
                                                elem_id=f"{prefix}-import")
        self.deleted = gr.State(NO_CONVERSATION)  # the conversation Undo brings back
        self.undo_ends = gr.Timer(UNDO_S, active=False)  # then the offer to undo goes
        self.current = gr.BrowserState(NO_CONVERSATION, storage_key=f"ai-studio-{prefix}-conversation",
                                       secret=secret)
        self.relist: dict = {}  # event arguments that refresh the list (`event.then(**sidebar.relist)`), once wired
        self.viewing = Viewing()

    def wire(self, service: StudioService, page: gr.Blocks, view: list, show: Callable[[dict], tuple],
             empty: Callable[[], tuple], status: gr.Markdown) -> None:
        """`view`: the components that show a conversation, `show(found)` their values for a stored one,
        `empty()` theirs for a new one; `status`: where the sidebar's messages go."""
        tool, current, title = self.tool, self.current, self.title
        store = service.store

        def listing(query: str, current: int, request: gr.Request) -> gr.Radio:
            """This user's conversations of `tool`, newest first, or those whose title or messages hold every
            word of `query` (saying so when none does)."""
            user = user_of(request)
            searching = bool(query and query.strip())
            found = [c for c in (store.search(user, query) if searching else store.list(user, tool))
                     if c["tool"] == tool]
            label = f"No conversations match “{query.strip()}”" if searching and not found else "Conversations"
            now = time.time()
            marked = self.viewing.streaming
            return gr.Radio(choices=[(("● " if c["id"] in marked else "") + listed(c, now), c["id"]) for c in found],
                            label=label,
                            value=current if current != NO_CONVERSATION else None)

        def opened(conversation: int, request: gr.Request) -> tuple:
            found = store.open(user_of(request), conversation)
            self.viewing.show(request.session_hash, Shown(conversation, history_of(found), continuable(found)))
            return *show(found), conversation, found["title"]

        @shown_to_user
        def open_conversation(conversation: int | None, request: gr.Request) -> tuple:
            if conversation is None:  # the list's choice cleared
                return (gr.skip(),) * (len(view) + 2)
            return opened(conversation, request)

        def reopen(conversation: int, request: gr.Request) -> tuple:
            """At page load: the conversation this browser had open, if it is still there (and this user's)."""
            if conversation != NO_CONVERSATION:
                try:
                    return opened(conversation, request)
                except UserError:
                    pass
            self.viewing.show(request.session_hash, Shown(NO_CONVERSATION))
            return *empty(), NO_CONVERSATION, ""

        def new(request: gr.Request) -> tuple:
            self.viewing.show(request.session_hash, Shown(NO_CONVERSATION))
            return *empty(), NO_CONVERSATION, "", ""

        @shown_to_user
        def rename(conversation: int, title: str, request: gr.Request) -> None:
            needs_one(conversation, "rename")
            store.rename(user_of(request), conversation, title)

        @shown_to_user
        def delete(conversation: int, request: gr.Request) -> tuple:
            """Deleted, with Undo offered for `UNDO_S` seconds."""
            needs_one(conversation, "delete")
            title = store.delete(user_of(request), conversation) or NEW_TITLE
            self.viewing.show(request.session_hash, Shown(NO_CONVERSATION))
            return (*empty(), NO_CONVERSATION, "", f"Deleted “{title}”. Undo brings it back for {UNDO_S} s.",
                    conversation, gr.Button(visible=True), gr.Timer(active=True))

        @shown_to_user
        def undo(conversation: int, request: gr.Request) -> tuple:
            store.restore(user_of(request), conversation)
            return *opened(conversation, request), "Restored.", NO_CONVERSATION, gr.Button(visible=False), \
                gr.Timer(active=False)

        def export(conversation: int | None, request: gr.Request) -> str:
            """One conversation (with its picture), or all of this user's when `conversation` is None."""
            needs_one(conversation, "export")
            conversations = store.export(user_of(request), conversation)
            if not conversations:
                raise UserError("there are no conversations to export yet")
            return write_download(to_archive(conversations).encode(), "conversations-", ".json")

        def export_all(request: gr.Request) -> str:
            return export(None, request)

        @shown_to_user
        def import_file(path: str | None, request: gr.Request) -> tuple:
            """A file of conversations (an archive, or one chat) into the store; the last one here opens."""
            if not path:
                raise UserError("choose a conversation file (.json or .md) to import")
            found = read_conversations(Path(path).read_bytes(), Path(path).name)
            ids = store.import_(user_of(request), found)
            here = [i for i, c in zip(ids, found) if c.get("tool") == tool]
            line = (f"Imported {len(found[0]['messages'])} messages." if len(found) == 1 and here else
                    f"Imported {len(ids)} conversations" + (f" ({len(ids) - len(here)} listed in the other tab)."
                                                            if len(here) < len(ids) else "."))
            if not here:
                return (gr.skip(),) * (len(view) + 2) + (line,)
            return *opened(here[-1], request), line

        self.relist = relist = dict(fn=listing, inputs=[self.search, current], outputs=self.conversations,
                                    api_visibility="private")
        private = dict(api_visibility="private")
        self.new.click(new, None, [*view, current, title, status],
                       **private).then(**relist)
        self.conversations.input(open_conversation, [self.conversations], [*view, current, title], **private) \
            .then(None, js=FOLD_JS, **private).then(**relist)  # (a reply streaming elsewhere: marked)
        self.search.change(**relist)
        current.change(**relist)  # a new conversation (its id comes with a reply's first update) is listed at once
        for renaming in (self.rename.click, self.title.submit):  # the button, or Enter in the title box
            renaming(rename, [current, title], None, **private).success(**relist)
        undoing = [self.deleted, self.undo, self.undo_ends]
        self.delete.click(delete, [current], [*view, current, title, status, *undoing], **private).success(**relist)
        self.undo.click(undo, [self.deleted], [*view, current, title, status, *undoing], **private).success(**relist)
        self.undo_ends.tick(lambda: (NO_CONVERSATION, gr.Button(visible=False), gr.Timer(active=False)), None,
                            undoing, **private)
        self.toggle.click(None, js=TOGGLE_JS, **private)
        download_on_click(self.export_one, export, [current], f"{self.prefix}-export-one")
        download_on_click(self.export_all, export_all, None, f"{self.prefix}-export-all")
        self.importer.upload(import_file, [self.importer], [*view, current, title, status], **private).success(**relist)
        page.load(reopen, [current], [*view, current, title], **private).then(**relist)
