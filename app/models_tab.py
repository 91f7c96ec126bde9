"""The Models tab: the models on this machine, switching a tool to one, downloading from the hub,
deleting (after asking). Wiring only: finding, switching, downloading and deleting are the catalog's
and the service's."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import gradio as gr

from app.errors import shown_to_user
from pipeline.errors import UserError
from pipeline.progress import lines_of
from pipeline.service.studio import StudioService
from pipeline.models import ModelEntry
from pipeline.service.tools import Tool, size_text

COLUMNS = ["Model", "Kind", "Parameters", "On disk", "Memory", "Fits", "Where", "In use by"]
ENGINE_COLUMNS = ["Family", "Runs as"]  # engine terms: with --verbose only (then the table scrolls in its box)
NOTHING_TO_DELETE = "Nothing to delete: every model here came with the app, is a demo, or is in use."
NOTHING_TO_CANCEL = "No download is running: there is nothing to cancel."


def count_text(n: int | None) -> str:
    """A parameter count as people write it: 0.2 M, 135 M, 7.6 B."""
    if not n:
        return ""
    value, unit = (n / 1e9, "B") if n >= 1e9 else (n / 1e6, "M")
    return f"{value:.2g} {unit}" if value < 10 else f"{value:.0f} {unit}"


def fits_text(entry: ModelEntry, room: tuple[int, str] | None, in_use: bool) -> str:
    """Whether the model fits the room there is (`memory_room`: a GPU's budget, or the memory the CPU has free);
    a model in use on the CPU already holds its memory, so the free memory says nothing about it."""
    if in_use and room is not None and room[1] == "free":
        return "in use"
    fits = entry.fits(room[0] if room else None)
    return "yes" if fits else f"no ({size_text(room[0])} {room[1]})" if fits is not None else ""


def model_table(entries: list[ModelEntry], room: tuple[int, str] | None, using: dict[str, str | None],
                verbose: bool = False) -> tuple[list, list]:
    """(the columns, a row per model): its kind (a GGUF file's quantization with it), the memory it takes here (a
    GPU's, or the CPU's), whether it fits the `room` there is for it (no "Fits" column where there is no limit)
    and what uses it; `verbose` adds its family and what its weights run as."""
    columns = COLUMNS + ENGINE_COLUMNS if verbose else list(COLUMNS)
    if room is None:
        columns.remove("Fits")
    rows = []
    for e in entries:
        users = [t for t, m in using.items() if m in (e.id, str(e.path))]
        cells = {"Model": e.id, "Kind": e.kind + (f" · {e.quant}" if e.quant else ""), "Parameters": count_text(e.params),
                 "On disk": size_text(e.disk_bytes) if e.path else "",
                 "Memory": size_text(e.memory_bytes) if e.memory_bytes is not None else "",
                 "Fits": fits_text(e, room, bool(users)), "Where": e.source, "In use by": ", ".join(users),
                 "Family": e.family, "Runs as": e.precision}
        rows.append([cells[c] for c in columns])
    return columns, rows


WIDTHS = {"Model": 24, "Kind": 10, "Parameters": 9, "On disk": 8, "Memory": 9, "Fits": 9, "Where": 18, "In use by": 13,
          "Family": 9, "Runs as": 14}  # shares of the page's width: the cells wrap, no column pushes another out


def column_widths(headers: list[str]) -> list[str]:
    total = sum(WIDTHS[h] for h in headers)
    return [f"{100 * WIDTHS[h] / total:.1f}%" for h in headers]


SWITCHES = ((Tool.CHAT, "Chat model"), (Tool.IMAGE_CHAT, "Image-chat model"), (Tool.SEGMENT, "Segment (SAM)"))


def build_models_tab(service: StudioService, header: dict) -> dict:
    """The tab's components; returns the event arguments that refresh its lists (on opening the tab).
    `header`: the event arguments that refresh the page's header, run once a switch ends."""
    catalog = service.catalog
    downloads: dict[str, threading.Event] = {}  # a session's download in progress, to cancel

    def table() -> gr.Dataframe:
        headers, rows = model_table(catalog.models(), catalog.room(), catalog.in_use(), service.verbose)
        return gr.Dataframe(rows, headers=headers, column_widths=column_widths(headers))

    def refresh() -> tuple:
        entries = catalog.refresh()  # the tab opened, or a switch, download or delete ended: look again
        pickers = [gr.Dropdown(choices=[e.id for e in entries if tool in e.tools], value=catalog.current(tool))
                   for tool, _ in SWITCHES]
        deletable = [e.id for e in entries if e.deletable]
        return table(), *pickers, gr.Dropdown(choices=deletable, value=None, visible=bool(deletable)), \
            gr.Button(visible=bool(deletable)), gr.Markdown(visible=not deletable)

    def switcher(tool: Tool) -> Callable:
        @shown_to_user
        def switch(model_id: str | None) -> Iterator[str]:
            if not model_id:
                raise UserError(f"pick the {tool} model to switch to")
            said: list[str] = []
            for line in service.switch(tool, model_id):
                said.append(line)
                yield "\n\n".join(said)
        return switch


    @shown_to_user
    def download(repo_id: str, request: gr.Request) -> Iterator[str]:
        cancel = downloads[request.session_hash] = threading.Event()
        try:
            for line in lines_of(lambda say: catalog.download(repo_id, say, cancel), "download"):
                yield f"{(repo_id or '').strip()}: {line}"
        finally:
            downloads.pop(request.session_hash, None)
        yield f"Downloaded {repo_id.strip()}: it is listed above, ready to switch to."

    def cancel_download(request: gr.Request) -> str | object:
        """This session's download from the box; with none, the first-use download of a tool's load; with
        neither, a line saying there is nothing to cancel (the download's own lines say how it ended)."""
        if request.session_hash in downloads:
            downloads[request.session_hash].set()
        elif not catalog.cancel_first_use():
            return NOTHING_TO_CANCEL
        return gr.skip()

    @shown_to_user
    def ask_delete(model_id: str | None) -> tuple:
        if not model_id:
            raise UserError("pick the model to delete")
        return catalog.delete_plan(model_id)[1], gr.Button(visible=True)

    @shown_to_user
    def delete(model_id: str) -> tuple:
        return catalog.delete(model_id), gr.Button(visible=False)

    gr.Markdown("The models on this machine, and what each tool uses. Switch a tool to another below (a reply "
                "already streaming finishes first), download one from the Hugging Face hub, or delete one you "
                "downloaded. **Cancel download** also stops a tool's own first download; using the tool starts it "
                "again.", elem_id="models-intro")
    models = gr.Dataframe(interactive=False, elem_id="models-table", wrap=True)
    status = gr.Markdown("", elem_id="models-status")
    pickers, buttons = [], []
    with gr.Row():
        for tool, label in SWITCHES:
            with gr.Column(min_width=220):
                pickers.append(gr.Dropdown([], label=label, elem_id=f"models-{tool.flag}"))
                buttons.append(gr.Button(f"Switch {tool}", size="sm"))
    with gr.Row():
        with gr.Column():
            repo = gr.Textbox(label="Download from the Hugging Face hub (a model, or a GGUF repository:TAG for "
                                    "one of its files)",
                              placeholder="Qwen/Qwen2.5-0.5B-Instruct or Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M",
                              elem_id="models-download-id")
            with gr.Row():
                fetch = gr.Button("Download", size="sm")
                cancel = gr.Button("Cancel download", size="sm")
        with gr.Column():
            doomed = gr.Dropdown([], label="Delete a downloaded model", elem_id="models-delete")
            ask = gr.Button("Delete…", size="sm", variant="stop", elem_id="models-ask-delete")
            nothing = gr.Markdown(NOTHING_TO_DELETE, visible=False, elem_id="models-nothing-to-delete")
            confirm = gr.Button("Yes, delete its files", size="sm", variant="stop", visible=False)
    outputs = [models, *pickers, doomed, ask, nothing]
    relist = dict(fn=refresh, inputs=None, outputs=outputs, api_visibility="private")
    for (tool, _), picker, button in zip(SWITCHES, pickers, buttons):
        button.click(switcher(tool), picker, status, api_visibility="private",
                     concurrency_limit=None).then(**relist).then(**header)
    fetch.click(download, repo, status, api_visibility="private", concurrency_limit=None).then(**relist)
    cancel.click(cancel_download, None, status, api_visibility="private")
    ask.click(ask_delete, doomed, [status, confirm], api_visibility="private")
    confirm.click(delete, doomed, [status, confirm], api_visibility="private").then(**relist)
    doomed.input(lambda: gr.Button(visible=False), None, confirm, api_visibility="private")
    return relist
