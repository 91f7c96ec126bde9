"""The plan: what the configuration means on this machine — device, dtype, each part's backend, the
chat and segment models — with one note per decision, which the terminal, `--check` and the page show.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from engine_builder import onnxruntime_backend
from pipeline.errors import UserError
from pipeline.minigpt4.weights import DEMO_LLM, demo_parts
from pipeline.models import CHAT_MODELS, EMBEDDED, auto_model, cache_dir, hub_offline, locate
from pipeline.sam.weights import DEMO as SAM_DEMO
from pipeline.sam.weights import SIZES as SAM_SIZES
from pipeline.sam.weights import locate_sam
from pipeline.service.tools import Tool
from pipeline.llm.weights.checkpoint import read_config
from studio.backends import BackendChoice, choose_llm_backend, choose_vision_backend, gguf_modes
from studio.memory_fit import GGUF
from studio.onnx_llm import unavailable as onnx_unavailable
from studio.config import StudioConfig
from studio.vlm import SIZES as VLM_SIZES
from studio.vlm import local_folder, model_name, vlm_id

# The plan's parts: the LLMs and vision networks each tool runs (image chat has one of each).
CHAT, IMAGE_CHAT_LLM, IMAGE_CHAT_VISION, SEGMENT = "chat", "image chat LLM", "image chat vision", "segment"
GPU_HINT = " — for GPU speed see --help"
PART_TOOLS = {CHAT: Tool.CHAT, IMAGE_CHAT_LLM: Tool.IMAGE_CHAT, IMAGE_CHAT_VISION: Tool.IMAGE_CHAT, SEGMENT: Tool.SEGMENT}


@dataclasses.dataclass(frozen=True)
class Plan:
    backends: dict[str, BackendChoice]  # per part above
    device: str
    dtype: str
    model_id: str
    sam: str
    notes: tuple[tuple[Tool | None, str], ...]  # (the tool it is about, None: all; the note)
    vlm: str | None = None  # Image chat's VLM (hub id or folder); None: MiniGPT-4
    chat_cpu_weights: str = ""  # what the chat's weights run as on the CPU, where not the dtype (a GGUF file's blocks)
    offline: str = ""  # why the hub cannot give the models auto would download ("": it can, or none is needed)

    @property
    def remote_chat(self) -> bool:
        return self.backends[CHAT].backend == "remote"


@dataclasses.dataclass(frozen=True)
class ImageChatParts:
    """MiniGPT-4's checkpoint, vision folder and LLM folder: the given files, or the demo built into the cache."""

    ckpt: Path
    vision_dir: Path
    llm_dir: Path
    llm_id: str
    is_demo: bool


def image_chat_parts(config: StudioConfig) -> ImageChatParts:
    if config.minigpt4_ckpt:
        return ImageChatParts(config.minigpt4_ckpt, config.minigpt4_vision, config.minigpt4_llm,
                              config.minigpt4_llm.name, False)
    return ImageChatParts(*demo_parts(cache_dir()), DEMO_LLM, True)


def _device(config: StudioConfig) -> tuple[str, str]:
    """(the device, the note saying what it is)."""
    has_gpu = torch.cuda.is_available()
    device = ("cuda" if has_gpu else "cpu") if config.device == "auto" else config.device
    kind, _, index = device.partition(":")
    if device != "cpu" and (kind != "cuda" or not (index.isdigit() or index == "")):
        raise UserError(f"--device {device}: use auto, cpu, cuda or cuda:N")
    if kind == "cuda" and int(index or 0) >= (count := torch.cuda.device_count() if has_gpu else 0):
        raise UserError(f"--device {device}: PyTorch sees {count} CUDA GPU(s) (torch {torch.__version__})")
    return device, f"device {device}: " + (torch.cuda.get_device_name(device) if kind == "cuda"
                                           else "no CUDA GPU found" if config.device == "auto" else "asked for")


def _backends(config: StudioConfig, device: str) -> dict[str, BackendChoice]:
    backends = {CHAT: choose_llm_backend(config.backend_for(Tool.CHAT), device),
                IMAGE_CHAT_LLM: choose_llm_backend(config.backend_for(Tool.IMAGE_CHAT), device),
                IMAGE_CHAT_VISION: choose_vision_backend(config.backend_for(Tool.IMAGE_CHAT), device),
                SEGMENT: choose_vision_backend(config.backend_for(Tool.SEGMENT), device)}
    if config.llm_endpoint:
        backends[CHAT] = BackendChoice("remote", f"the OpenAI-compatible server at {config.llm_endpoint}; "
                                                 f"image chat and segment stay local")
    return backends


def _chat_model(config: StudioConfig, device: str) -> tuple[str, list[str], str]:
    """The chat model, notes on why, and what its weights run as on the CPU where that is not the dtype."""
    if config.llm_endpoint:
        return config.llm_model or "(the server's first model)", [], ""
    notes = []
    if config.model == "auto" and config.weights is None:
        model_id, why = auto_model(device.startswith("cuda"))
        notes.append(f"model {model_id}: {why}")
    else:
        model_id = config.model if config.model != "auto" else str(config.weights)
        if model_id not in CHAT_MODELS and not Path(model_id).is_dir() and config.weights is None:
            notes.append(f"model {model_id}: not in the registry, trying it as a hub id")
    found = locate(model_id, config.weights)
    notes.append(f"weights: {found.source}" + (f" ({found.path})" if found.path else ""))
    if found.path is not None and (found.path / "config.json").is_file():
        decoder = read_config(found.path)
        modes, why = gguf_modes(decoder)
        on_onnx = why and config.quant in ("auto", GGUF) and onnx_unavailable(decoder) is None
        if why and config.quant == "auto":  # what a GGUF file runs as, and why
            runs_as = "its own blocks (--quant gguf)" if modes[0] == GGUF else modes[0]
            notes.append(f"a {decoder.gguf_type} GGUF file: on a GPU --quant auto runs it as {runs_as} ({why}); on "
                         f"the CPU " + ("as stored, on ONNX Runtime" if on_onnx else "in float"))
        if on_onnx:
            return model_id, notes, f"its {decoder.gguf_type} blocks as stored, ONNX Runtime"
    return model_id, notes, ""


def _sam(config: StudioConfig, device: str, offline: Callable[[], str]) -> tuple[str, list[str]]:
    """auto: SAM ViT-H on a GPU where it is in the cache, else MobileSAM, downloaded on first use; offline with
    MobileSAM not here, the demo SAM (said before any click; a download that fails later falls back too,
    `compose.load_segment`)."""
    sam, notes = config.sam, []
    if sam == "auto":
        vit_h = locate_sam("sam_vit_h", cache_dir())[1] == "cache"
        sam = "sam_vit_h" if device.startswith("cuda") and vit_h else "mobile_sam"
        if locate_sam(sam, cache_dir())[1] == "download" and (why := offline()):
            return SAM_DEMO, [f"segment model: the demo SAM (random weights): MobileSAM is not on this machine and "
                              f"cannot be downloaded now ({why})"]
        notes.append(f"segment model {sam}: " + ("CUDA GPU and the checkpoint in the cache" if vit_h else
                     f"MobileSAM ({SAM_SIZES['mobile_sam']}); --sam sam_vit_h for the largest SAM"))
    return sam, notes + [f"segment weights: {locate_sam(sam, cache_dir())[1]}"]


def headlines(config: StudioConfig, plan: Plan) -> list[tuple[Tool, str]]:
    """One line per tool in a user's words: what runs and where (the why is in `plan.notes`)."""
    on_gpu = plan.device.startswith("cuda")

    def where(part: str, hint: str = "", cpu_weights: str = "") -> str:
        backend = plan.backends[part].backend
        return f"on the GPU ({backend}, {plan.dtype})" if on_gpu else f"on the CPU ({cpu_weights or plan.dtype}){hint}"

    chat_where = where(CHAT, GPU_HINT, plan.chat_cpu_weights)
    if plan.remote_chat:
        chat = f"Chat: {config.llm_model or 'the model'} served at {config.llm_endpoint}"
    elif plan.model_id == EMBEDDED:
        chat = f"Chat: SmolLM2-135M-Instruct, the small model that comes with the app, {chat_where}"
    elif plan.model_id.startswith("demo/"):
        chat = f"Chat: {plan.model_id}, a demo with random weights (its replies mean nothing), {chat_where}"
    else:
        chat = f"Chat: {plan.model_id} {chat_where}"
    vlm = plan.vlm
    if vlm is not None:
        name = model_name(vlm)
        image = f"Image chat: {name}, {VLM_SIZES.get(vlm, 'a download')}, downloads on first use, " \
            if local_folder(vlm) is None else f"Image chat: {name} "
    elif config.minigpt4_ckpt:
        image = "Image chat: MiniGPT-4 "
    else:
        wanted = vlm_id(config, plan.device) if config.vlm == "auto" else None
        image = "Image chat: a demo MiniGPT-4 with random weights (its answers mean nothing" + (
            f"; offline: {model_name(wanted)}, a {VLM_SIZES.get(wanted, 'download')} download, answers once online), "
            if plan.offline and wanted else "), ")
    segment = "Segment: " + _segment_model(plan.sam, plan.offline)
    # a SmolVLM's decoder on the CPU: 8-bit blocks on ONNX Runtime (`studio/vlm.load_vlm`; its widths are whole blocks)
    smolvlm_low_bit = vlm is not None and "smolvlm" in vlm.lower() and config.quant in ("auto", "int8") and \
        onnxruntime_backend.unavailable() is None
    image_weights = "its decoder as 8-bit blocks on ONNX Runtime" if smolvlm_low_bit else ""
    return [(Tool.CHAT, chat), (Tool.IMAGE_CHAT, image + where(IMAGE_CHAT_VISION, cpu_weights=image_weights)),
            (Tool.SEGMENT, segment + where(SEGMENT))]


def _segment_model(sam: str, offline: str) -> str:
    if sam == SAM_DEMO and offline:
        return (f"a demo SAM with random weights (its masks mean nothing; offline: MobileSAM, a "
                f"{SAM_SIZES['mobile_sam']} download, gives real masks once online, or --sam /path/to/mobile_sam.pt), ")
    if sam == SAM_DEMO:
        return f"a demo SAM with random weights (--sam mobile_sam for real masks: a {SAM_SIZES['mobile_sam']} download), "
    name = "MobileSAM" if sam == "mobile_sam" else f"SAM ({sam})"
    if locate_sam(sam, cache_dir())[1] == "download":
        return f"{name}, {SAM_SIZES[sam]}, downloads on first use, "
    return f"{name} "


def make_plan(config: StudioConfig) -> Plan:
    device, device_note = _device(config)
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    backends = _backends(config, device)
    model_id, model_notes, chat_cpu_weights = _chat_model(config, device)
    asked: list[str] = []  # the hub is asked at most once, and only where auto would download a model

    def offline() -> str:
        if not asked:
            asked.append(hub_offline())
        return asked[0]

    sam, sam_notes = _sam(config, device, offline)
    quant = f"LLM weights: --quant {config.quant}" + (" (at load: float where the weights fit the free memory, "
                                                      "else int8, else int4)" if config.quant == "auto" else "")
    vlm = vlm_id(config, device)  # a VLM unless MiniGPT-4 is asked for: the MiniGPT-4 demo only where none can come
    if vlm is not None and config.vlm == "auto" and local_folder(vlm) is None and offline():
        image = (f"image chat: the demo MiniGPT-4 (random weights): {model_name(vlm)} is not on this machine and "
                 f"cannot be downloaded now ({offline()})")
        vlm = None
    else:
        image = "image chat: MiniGPT-4 from the given files" if config.minigpt4_ckpt else \
            "image chat: the built-in demo MiniGPT-4 (random weights); pass --minigpt4-* for the real one" \
            if vlm is None else f"image chat model {vlm}" + (f" ({VLM_SIZES.get(vlm, 'a download')})"
                                                             if local_folder(vlm) is None else "")
    notes = [(None, device_note), *((PART_TOOLS[part], f"{part}: {choice.backend} ({choice.why})")
                                    for part, choice in backends.items()),
             (Tool.CHAT, quant), *((Tool.CHAT, n) for n in model_notes), *((Tool.SEGMENT, n) for n in sam_notes),
             (Tool.IMAGE_CHAT, image)]
    return Plan(backends, device, dtype, model_id, sam, tuple(notes), vlm, chat_cpu_weights, asked[0] if asked else "")
