"""The whole app: one tab per tool, a banner saying what runs where."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import gradio as gr

from app.chat_tab import build_chat_tab
from app.image_chat_tab import build_image_chat_tab
from app.segment_tab import build_segment_tab
from pipeline.chat import ChatPipeline
from pipeline.files import atomic_write
from pipeline.image_chat import ImageChatPipeline
from pipeline.models import cache_dir
from pipeline.segment import SegmentPipeline

EXAMPLES = Path(__file__).resolve().parents[1] / "assets" / "examples"

DEMO_WARNING = ("**Demo model.** No real weights were found, so a tiny built-in model with *random weights* "
                "is running: its replies are meaningless text. Start with `--model Qwen/Qwen2.5-7B-Instruct` "
                "(or `--weights FOLDER`) on a GPU for real answers.")
MINIGPT4_DEMO_WARNING = ("**Demo MiniGPT-4.** Tiny vision and language models with *random weights* are running: "
                         "the answers are meaningless text. Pass `--minigpt4-ckpt`, `--minigpt4-vision` and "
                         "`--minigpt4-llm` (see README) for the real MiniGPT-4.")
SAM_DEMO_WARNING = ("**Demo SAM.** A tiny SAM with *random weights* is running: masks follow your clicks "
                    "mechanically but mean nothing. Start with `--sam sam_vit_h` (downloads 2.4 GB) or "
                    "`--sam /path/to/sam_vit_h_4b8939.pth` for real masks.")


def example_images() -> list[str]:
    """The sample photos offered by the image tabs."""
    return sorted(str(p) for p in EXAMPLES.glob("*.jpg"))


def browser_storage_secret() -> str:
    """A per-installation key for what the UI keeps in the browser, made once and kept private, so
    conversations saved in the browser survive an app restart."""
    path = cache_dir() / "browser-storage.key"
    if not path.is_file():
        atomic_write(path, secrets.token_urlsafe(32), mode=0o600)
    return path.read_text().strip()


def build_app(chat: ChatPipeline, image_chat: ImageChatPipeline, segment: SegmentPipeline,
              startup: list[str]) -> gr.Blocks:
    """`startup`: what start-up chose and did (backends and why, engines built or loaded, with times)."""
    with gr.Blocks(title="AI Studio") as demo:
        gr.Markdown("## AI Studio — chat, image chat and segmentation on your own GPU")
        if chat.is_demo:
            gr.Markdown(DEMO_WARNING)
        gr.Markdown(" · ".join([chat.description, image_chat.description, segment.description]))
        with gr.Accordion("Start-up: what runs where, and why", open=False):
            gr.Markdown("\n".join(f"- {line}" for line in startup), elem_id="startup-report")
        with gr.Tab("Chat"):
            build_chat_tab(chat, demo, browser_storage_secret())
        with gr.Tab("Image chat"):
            if image_chat.is_demo:
                gr.Markdown(MINIGPT4_DEMO_WARNING)
            build_image_chat_tab(image_chat, example_images())
        with gr.Tab("Segment"):
            if segment.is_demo:
                gr.Markdown(SAM_DEMO_WARNING)
            build_segment_tab(segment, example_images())

        def engine_status() -> str:
            """API: what the LLM engines are doing now, as JSON {"chat": {...}, "image_chat": {...}}
            (requests running and queued, batch size, cache rows, decode steps so far), and "startup":
            the start-up report's lines."""
            return json.dumps({"chat": chat.llm.engine.status(), "image_chat": image_chat.llm.engine.status(),
                               "startup": startup})

        gr.api(engine_status, api_name="engine_status")
    return demo
