"""The whole app: one tab per tool, a banner saying what runs where."""

from __future__ import annotations

import os
import secrets

import gradio as gr

from app.chat_tab import build_chat_tab
from pipeline.chat import ChatPipeline
from pipeline.models import cache_dir

DEMO_WARNING = ("**Demo model.** No real weights were found, so a tiny built-in model with *random weights* "
                "is running: its replies are meaningless text. Start with `--model Qwen/Qwen2.5-7B-Instruct` "
                "(or `--weights FOLDER`) on a GPU for real answers.")


def browser_storage_secret() -> str:
    """A per-installation key for what the UI keeps in the browser, made once and kept private, so
    conversations saved in the browser survive an app restart."""
    path = cache_dir() / "browser-storage.key"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(secrets.token_urlsafe(32))
        tmp.chmod(0o600)
        os.replace(tmp, path)
    return path.read_text().strip()


def build_app(chat: ChatPipeline, runtime_notes: list[str]) -> gr.Blocks:
    with gr.Blocks(title="AI Studio") as demo:
        gr.Markdown("## AI Studio — chat, image chat and segmentation on your own GPU")
        if chat.is_demo:
            gr.Markdown(DEMO_WARNING)
        gr.Markdown(" · ".join([chat.description] + runtime_notes))
        with gr.Tab("Chat"):
            build_chat_tab(chat, demo, browser_storage_secret())
        with gr.Tab("Image chat"):
            gr.Markdown("Image chat (MiniGPT-4) is coming: upload an image and talk about it.")
        with gr.Tab("Segment"):
            gr.Markdown("Segment (SAM) is coming: click on an image to get masks.")
    return demo
