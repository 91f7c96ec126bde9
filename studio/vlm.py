"""Which vision-language model Image chat runs, and getting its folder: SmolVLM by default, from the hub on
first use (progress, a dropped connection resumed); MiniGPT-4 where its three checkpoints are given.

Offline with nothing cached, `--vlm auto` falls back to the MiniGPT-4 demo (`compose.load_image_chat`
says so); a VLM asked for by name fails with the reason.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from pipeline.errors import UserError
from pipeline.models import download_failure, hub_reachable
from studio.config import StudioConfig
from studio.hub_progress import progress_class

SMOLVLM = "HuggingFaceTB/SmolVLM-256M-Instruct"
NAMES = {"smolvlm": SMOLVLM, "smolvlm-500m": "HuggingFaceTB/SmolVLM-500M-Instruct"}
SIZES = {SMOLVLM: "0.5 GB", NAMES["smolvlm-500m"]: "1.0 GB"}
FILES = ["*.json", "*.safetensors", "*.jinja"]  # weights, configs, tokenizer, processor and chat template


def vlm_id(config: StudioConfig) -> str | None:
    """The SmolVLM hub id or folder Image chat runs; None: MiniGPT-4 (its checkpoints given, or its demo)."""
    if config.minigpt4_ckpt or config.vlm == "minigpt4":
        return None
    return SMOLVLM if config.vlm == "auto" else NAMES.get(config.vlm, config.vlm)


def local_folder(model_id: str) -> Path | None:
    """The folder, where it is one or the hub cache holds the model; None: it needs a download."""
    if Path(model_id).is_dir():
        return Path(model_id)
    try:
        return Path(snapshot_download(model_id, allow_patterns=FILES, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def fetch(model_id: str, say: Callable[[str], None]) -> Path:
    """The model's folder, downloaded into the hub cache if it is not there (progress to `say`)."""
    found = local_folder(model_id)
    if found is not None:
        return found
    say(f"image chat: downloading {model_id} ({SIZES.get(model_id, 'its weights')})")
    try:
        hub_reachable()
        folder = Path(snapshot_download(model_id, allow_patterns=FILES,
                                        tqdm_class=progress_class(say, threading.Event())))
    except (OSError, ValueError, HfHubHTTPError) as e:
        raise UserError(f"could not download {model_id} from the Hugging Face hub: {download_failure(e)}") from None
    if not (folder / "config.json").is_file():
        raise UserError(f"{model_id} has no config.json: it is not a model this app can run")
    return folder
