"""The whole app: one tab per tool, a banner saying what runs where."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import gradio as gr
import torch

from app.chat_tab import build_chat_tab
from app.documents_tab import build_documents_tab
from app.downloads import KEEP_FILES_S
from app.errors import shown_to_user
from app.gradio_api import add_gradio_api
from app.image_chat_tab import build_image_chat_tab
from app.models_tab import build_models_tab
from app.page_style import DARK_TOGGLE_JS
from app.segment_tab import build_segment_tab
from pipeline.files import atomic_write
from pipeline.models import cache_dir
from pipeline.sam.weights import CHECKPOINTS as SAM_CHECKPOINTS
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool

EXAMPLES = Path(__file__).resolve().parents[1] / "assets" / "examples"

DEMO_WARNING = ("**Demo model:** its replies are meaningless text.<span class='studio-more'> No real weights were "
                "found, so a tiny built-in model with *random weights* is running. Start with "
                "`--model Qwen/Qwen2.5-7B-Instruct` (or `--weights FOLDER`) on a GPU for real answers.</span>")
MINIGPT4_DEMO_WARNING = ("**Demo MiniGPT-4.** Tiny vision and language models with *random weights* are running: "
                         "the answers are meaningless text. Pass `--minigpt4-ckpt`, `--minigpt4-vision` and "
                         "`--minigpt4-llm` (see README) for the real MiniGPT-4.")
SAM_DEMO_WARNING = ("**Demo SAM.** A tiny SAM with *random weights* is running: masks follow your clicks "
                    "mechanically but mean nothing. For real masks, start with `--sam mobile_sam` while online (40 MB, "
                    f"downloaded once), or fetch [mobile_sam.pt]({SAM_CHECKPOINTS['mobile_sam']}) on any machine and "
                    "start with `--sam /path/to/mobile_sam.pt` (`--sam sam_vit_h`: the largest SAM, 2.4 GB).")


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


def heading(device: torch.device) -> str:
    """The page's title, saying where the tools run (a laptop user reads "GPU" as something missing)."""
    where = "GPU" if device.type == "cuda" else "CPU"
    return f"## AI Studio<span class='studio-subtitle'> — chat, image chat and segmentation on this machine's {where}</span>"


def tools_line(service: StudioService) -> str:
    """One line for the tools: each one's model when loaded, else whether it is waiting for its first use
    (how it runs, in the engine's terms, is in the start-up panel, and here too with `--verbose`)."""
    return " · ".join(f"**{name}**: {state}" + (f", {description if service.verbose else title}" if title else "")
                      for name, (state, title, description) in service.tools().items())


def startup_lines(service: StudioService) -> str:
    """The start-up panel: what every user is told (what runs where, loads, fallbacks), then, folded, the
    details in the engine's terms (backends and why, each tool's engine, memory)."""
    told = set(service.startup_told)
    details = [line for line in service.startup if line not in told]
    return "\n".join(f"- {line}" for line in service.startup_told) + (
        "\n\n<details><summary>Details: engines, backends and memory</summary>\n\n" +
        "\n".join(f"- {line}" for line in details) + "\n\n</details>" if details else "")


def image_chat_demo_warning(service: StudioService) -> str:
    """Why image chat's answers mean nothing: the hub out of reach at start-up, MiniGPT-4's demo asked for, or a
    VLM that could not come."""
    if service.notice(Tool.IMAGE_CHAT):
        return service.notice(Tool.IMAGE_CHAT)
    planned = service.image_models()[-1]
    if planned == "minigpt4":
        return MINIGPT4_DEMO_WARNING
    return (f"**Demo image chat.** {planned} could not be downloaded, so a tiny MiniGPT-4 with *random weights* "
            f"answers: its replies mean nothing. Once online, restart the app (or pick the model in the Models "
            f"tab) for real answers.")


def header_lines(service: StudioService) -> tuple:
    """The page's header as it is now: the tools line, the start-up report, and the image tools' demo
    warnings (shown once a tool runs random weights: a first-use download that failed leaves its demo)."""
    return (tools_line(service), startup_lines(service),
            gr.Markdown(image_chat_demo_warning(service), visible=service.is_demo(Tool.IMAGE_CHAT)),
            gr.Markdown(sam_demo_warning(service), visible=service.is_demo(Tool.SEGMENT)))


def sam_demo_warning(service: StudioService) -> str:
    """Why Segment's masks mean nothing, and what brings real ones."""
    return service.notice(Tool.SEGMENT) or SAM_DEMO_WARNING


def build_app(service: StudioService, keep_files_s: int = KEEP_FILES_S) -> gr.Blocks:
    """The UI over `service`, whose start-up report (backends and why, engines built or loaded, with
    times) keeps growing as tools load on first use. Uploads and files made for download are deleted
    `keep_files_s` after they were made."""
    sweep = max(1, min(600, keep_files_s // 2))
    with gr.Blocks(title="AI Studio", delete_cache=(sweep, keep_files_s)) as demo:
        with gr.Row(equal_height=True):
            gr.Markdown(heading(service.host.device), elem_id="heading")
            gr.Button("◐ Light / dark", size="sm", scale=0, min_width=120, elem_id="theme-toggle") \
                .click(None, js=DARK_TOGGLE_JS, api_visibility="private")
        if service.is_demo(Tool.CHAT):
            gr.Markdown(DEMO_WARNING, elem_classes=["studio-banner"])
        elif service.notice(Tool.CHAT):
            gr.Markdown(service.notice(Tool.CHAT), elem_id="chat-model-notice")
        if service.store.notice:  # a damaged conversation database was set aside
            gr.Markdown(f"**Conversations:** {service.store.notice}", elem_id="store-notice")
        banner = gr.Markdown(tools_line(service), elem_id="tools-status")
        with gr.Accordion("Start-up: what runs where, and why", open=False):
            report = gr.Markdown(startup_lines(service), elem_id="startup-report")
        with gr.Tabs(overflow_behavior="wrap") as tabs:  # on a phone every tab stays in sight
            secret = browser_storage_secret()
            with gr.Tab("Chat", id="chat"):
                build_chat_tab(service, demo, secret)
            with gr.Tab("Image chat", id="image-chat"):
                image_demo = gr.Markdown(image_chat_demo_warning(service), visible=service.is_demo(Tool.IMAGE_CHAT),
                                         elem_id="image-chat-demo")
                image_chat = build_image_chat_tab(service, demo, example_images(), secret)
            with gr.Tab("Segment", id="segment"):
                segment_demo = gr.Markdown(sam_demo_warning(service), visible=service.is_demo(Tool.SEGMENT),
                                           elem_id="segment-demo")
                ask = build_segment_tab(service, example_images())
            with gr.Tab("Documents", id="documents") as documents_tab:
                listed = build_documents_tab(service)
            if listed is not None:
                documents_tab.select(**listed)
            header = dict(fn=lambda: header_lines(service), inputs=None, outputs=[banner, report, image_demo, segment_demo],
                          api_visibility="private", queue=False)
            if service.catalog is not None:
                with gr.Tab("Models", id="models") as models_tab:
                    models_tab.select(**build_models_tab(service, header))

        # "Ask about this": the selected object (a masked crop) and the question go to image chat, in a new
        # conversation there, which answers. The picture is shown by a plain return (not mid-stream), and a
        # mistake (nothing selected) leaves `pending` empty, so nothing is asked.
        pending = gr.State(None)

        @shown_to_user
        def select(t, text: str) -> tuple:
            picture, question = ask.selection(t, text)
            return gr.Tabs(selected="image-chat"), *image_chat.show(picture, question), (picture, question)

        @shown_to_user
        def answer(data: dict, request: gr.Request, fed: Callable):
            if data[pending] is not None:
                yield from image_chat.ask(*data[pending], data, request, fed)

        chosen = ask.button.click(lambda: None, None, pending, queue=False, api_visibility="private").then(
            select, [ask.state, ask.question], [tabs, *image_chat.outputs, pending], api_visibility="private")
        for ended in image_chat.composer.streams([chosen.then], answer, {pending, *image_chat.inputs},
                                                 image_chat.outputs):
            ended.then(**image_chat.relist)
        gr.Timer(3).tick(**header)
        demo.load(**header)

        add_gradio_api(service)
    return demo
