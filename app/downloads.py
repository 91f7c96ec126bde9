"""Files the user downloads (mask PNGs, exported conversations): written on demand into Gradio's
upload folder, then fetched by a download button that is in the page but hidden.

Why the hidden button: a `DownloadButton` downloads whatever file it already holds, so making the file
on every change (every streamed token, every click on a 12 MP photo) would cost more than the download.
A visible `Button` makes the file only when pressed and hands it to the hidden one, which the browser
then clicks."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gradio as gr
from gradio.utils import get_upload_folder

from app.errors import raised_to_client


KEEP_FILES_S = 3600  # how long uploads and made files stay on disk (`--keep-files`, set by `keep_files_for`)


def keep_files_for(seconds: int) -> None:
    """Start-up (`app.server`): how long made files stay, from `--keep-files`."""
    global KEEP_FILES_S
    KEEP_FILES_S = seconds


def write_download(data: bytes, prefix: str, suffix: str) -> str:
    """`data` as a new file in Gradio's own upload folder (the one place it serves files from without
    extra settings); files made there more than KEEP_FILES_S ago are removed first, so masks and
    exports do not pile up on a long-running server."""
    folder = Path(get_upload_folder()) / "downloads"
    folder.mkdir(parents=True, exist_ok=True)
    expired = time.time() - KEEP_FILES_S
    for old in folder.iterdir():
        with contextlib.suppress(OSError):  # another request may remove it first
            if old.stat().st_mtime < expired:
                old.unlink()
    with tempfile.NamedTemporaryFile(prefix=prefix, suffix=suffix, delete=False, dir=folder) as f:
        f.write(data)
    return f.name


def download_on_click(button: gr.Button, make: Callable[..., str], inputs, elem_id: str) -> None:
    """When `button` is pressed, `make(*inputs)` returns a file's path and the browser downloads it. A
    `UserError` is an error toast and nothing downloads (its only output is hidden: no badge shows)."""
    hidden = gr.DownloadButton(visible="hidden", elem_id=elem_id)
    button.click(raised_to_client(make), inputs, hidden, api_visibility="private").success(
        None, js=f"() => {{ const e = document.querySelector('#{elem_id}'); "
                 "(e.matches('a,button') ? e : e.querySelector('a,button')).click(); }")
