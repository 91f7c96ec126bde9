"""Which vision-language model Image chat runs, and getting its folder: on a GPU, Qwen2.5-VL where the hub
cache holds it; else SmolVLM, from the hub on first use (progress, Cancel, a dropped connection resumed);
MiniGPT-4 where its three checkpoints are given.

Offline with nothing cached, `--vlm auto` falls back to the MiniGPT-4 demo (`compose.load_image_chat`
says so); a VLM asked for by name fails with the reason.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from engine_builder.build import EngineOptions
from pipeline.errors import UserError
from pipeline.llm.weights.config import DecoderConfig
from pipeline.models import download_failure, folder_or_hub_id, hub_reachable
from pipeline.pipelines.qwen_vl_chat import QwenVLChatPipeline
from pipeline.pipelines.smolvlm_chat import SmolVLMChatPipeline
from pipeline.pipelines.vlm_chat import VLMChatPipeline
from pipeline.qwen_vl.text import text_config as qwen_vl_text_config
from pipeline.smolvlm.text import text_config as smolvlm_text_config
from pipeline.weights_io import read_json, weight_files
from studio.backends import choose_quant
from studio.onnx_llm import float_unavailable, onnx_float_decoder
from studio.config import StudioConfig
from studio.hub_progress import interruptible, progress_class

SMOLVLM = "HuggingFaceTB/SmolVLM-256M-Instruct"
QWEN_VL_7B, QWEN_VL_3B = "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct"
NAMES = {"smolvlm": SMOLVLM, "smolvlm-500m": "HuggingFaceTB/SmolVLM-500M-Instruct", "qwen2.5-vl-3b": QWEN_VL_3B,
         "qwen2.5-vl-7b": QWEN_VL_7B}
SIZES = {SMOLVLM: "0.5 GB", NAMES["smolvlm-500m"]: "1.0 GB", QWEN_VL_3B: "7.5 GB", QWEN_VL_7B: "16.6 GB"}
GPU_VLMS = (QWEN_VL_7B, QWEN_VL_3B)  # what `auto` takes on a GPU where the cache holds it, best first
# SmolLM2-135M's float weights as 8-bit blocks on ONNX Runtime against float32 torch, this 2-core CPU, 2026-11-29
CPU_AUTO = ("auto on the CPU: the decoder's weights as 8-bit blocks on ONNX Runtime (7.6× float32's decode speed at "
            "SmolVLM-256M's decoder shape)")
FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt"]  # weights, configs, tokenizer, processor, chat template


@dataclasses.dataclass(frozen=True)
class Kind:
    """A VLM family by its config.json `model_type`: its name, pipeline, decoder config and context (a
    Qwen2.5-VL picture takes up to 1,280 positions; SmolVLM's 17 tiles 1,088)."""

    family: str
    pipeline: type[VLMChatPipeline]
    text_config: Callable[[Path], DecoderConfig]
    context: int


_QWEN_VL = Kind("Qwen2.5-VL", QwenVLChatPipeline, qwen_vl_text_config, 4096)
_SMOLVLM = Kind("SmolVLM", SmolVLMChatPipeline, smolvlm_text_config, 2048)
KINDS = {"qwen2_5_vl": _QWEN_VL, "idefics3": _SMOLVLM, "smolvlm": _SMOLVLM}
FAMILIES = {model_type: kind.family for model_type, kind in KINDS.items()}


def vlm_id(config: StudioConfig, device: str = "cpu") -> str | None:
    """The VLM hub id or folder Image chat runs; None: MiniGPT-4 (its checkpoints given, or its demo)."""
    if config.minigpt4_ckpt or config.vlm == "minigpt4":
        return None
    if config.vlm != "auto":
        return NAMES.get(config.vlm) or _named(config.vlm)
    cached = [m for m in GPU_VLMS if local_folder(m) is not None] if device.startswith("cuda") else []
    return cached[0] if cached else SMOLVLM


def _named(value: str) -> str:
    """`--vlm VALUE` that is not one of `NAMES`: a folder or a hub id, else refused in one line."""
    folder_or_hub_id(value, "--vlm", f"{SMOLVLM} (or one of {', '.join([*NAMES, 'minigpt4', 'auto'])})")
    return value


def model_name(model_id: str) -> str:
    """What a person calls it: the hub id's or folder's last part ("SmolVLM-256M-Instruct")."""
    return model_id.rstrip("/").rsplit("/", 1)[-1]


def load_vlm(folder: Path, model_id: str, device: str, dtype: torch.dtype, max_batch: int, quant: str = "none",
             engines: EngineOptions | None = None, say: Callable[[str], None] = lambda line: None) -> VLMChatPipeline:
    """The folder's model on our engine, by its config's `model_type` (Qwen2.5-VL or SmolVLM), its decoder's
    weights as `--quant` says (auto: what fits the GPU, as for the chat model; on the CPU, int8 and auto run
    them as 8-bit blocks on ONNX Runtime where it can, built once into `engines`' cache)."""
    model_type = read_json(folder / "config.json").get("model_type")
    kind = KINDS.get(model_type)
    if kind is None:
        raise UserError(f"{model_id}'s config.json says model_type {model_type!r}: image chat runs SmolVLM (idefics3) "
                        f"and Qwen2.5-VL (qwen2_5_vl) folders")
    free = torch.cuda.mem_get_info(torch.device(device))[0] if device.startswith("cuda") else None
    config = kind.text_config(folder)
    mode, why = choose_quant(quant, config, dtype, torch.device(device), free, kind.context)
    engine_of = None
    if device == "cpu" and quant in ("auto", "int8") and mode in ("none", "int8") and float_unavailable(config) is None:
        def engine_of(decoder):
            return onnx_float_decoder(decoder, weight_files(folder), model_id, engines)
        mode, why = "int8", why if quant == "int8" else CPU_AUTO
    if why != "asked for":
        say(f"image chat: --quant {mode} ({why})")
    return kind.pipeline.load(folder, model_id, device, dtype, kind.context, max_batch,
                              "none" if engine_of else mode, engine_of)


def local_folder(model_id: str) -> Path | None:
    """The folder, where it is one or the hub cache holds the model; None: it needs a download."""
    if Path(model_id).is_dir():
        return Path(model_id)
    try:
        return Path(snapshot_download(model_id, allow_patterns=FILES, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def fetch(model_id: str, say: Callable[[str], None], cancel: threading.Event,
          tell: Callable[[str], None] | None = None) -> Path:
    """The model's folder, downloaded into the hub cache if it is not there (that it is, to `tell`, else `say`;
    progress to `say`); `cancel` set, or Ctrl+C, stops the download with `DownloadCancelled` (or the
    KeyboardInterrupt)."""
    found = local_folder(model_id)
    if found is not None:
        return found
    (tell or say)(f"image chat: downloading {model_id} ({SIZES.get(model_id, 'its weights')})")
    try:
        hub_reachable()
        folder = Path(interruptible(lambda: snapshot_download(model_id, allow_patterns=FILES,
                                                              tqdm_class=progress_class(say, cancel)), cancel))
    except (OSError, ValueError, HfHubHTTPError) as e:
        raise UserError(f"could not download {model_id} from the Hugging Face hub: {download_failure(e)}") from None
    if not (folder / "config.json").is_file():
        raise UserError(f"{model_id} has no config.json: it is not a model this app can run")
    return folder
