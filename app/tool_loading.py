"""A tool for a request: loaded on first use (or again after the memory budget unloaded it), with
its progress shown in the tab's status line while the user waits."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import gradio as gr

from pipeline.tools import ToolHost


def loading_updates(host: ToolHost, name: str, outputs: int) -> Iterator[tuple]:
    """While `name` loads (in a thread), one update per progress line: `outputs - 1` unchanged
    components and the status line last. Nothing when it is loaded; raises what the load raised."""
    if host.loaded(name) is not None:
        return
    lines: queue.SimpleQueue = queue.SimpleQueue()
    failed: list[BaseException] = []

    def load() -> None:
        try:
            host.load(name, lines.put)
        except BaseException as e:  # noqa: BLE001 - re-raised in the request's thread below
            failed.append(e)
        finally:
            lines.put(None)

    threading.Thread(target=load, name=f"load-{name}", daemon=True).start()
    yield (*[gr.skip()] * (outputs - 1), f"Loading {name} (first use, or unloaded to make room)…")
    while (line := lines.get()) is not None:
        yield (*[gr.skip()] * (outputs - 1), f"Loading {name}: {line}")
    if failed:
        raise failed[0]
