"""Which chat models exist, and where their files come from.

A model id resolves, in this order, to: a local folder given by the user; a built-in demo model
(built once into the cache); the Hugging Face cache; a download from the hub (progress bar in the
terminal). Only config, tokenizer and weight files are fetched: code in model repos (Qwen v1
ships some) is never downloaded or run.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from pipeline.errors import UserError
from pipeline.llm.demo import DEMO_MODELS, demo_model_dir

CHAT_MODELS = {
    "Qwen/Qwen-7B-Chat": "Qwen v1, 7B, tiktoken tokenizer, 8k context",
    "Qwen/Qwen-1_8B-Chat": "Qwen v1, 1.8B",
    "Qwen/Qwen2-7B-Instruct": "Qwen2, 7B",
    "Qwen/Qwen2.5-7B-Instruct": "Qwen2.5, 7B",
    "Qwen/Qwen2.5-3B-Instruct": "Qwen2.5, 3B",
    "Qwen/Qwen2.5-1.5B-Instruct": "Qwen2.5, 1.5B",
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen2.5, 0.5B",
    "Qwen/Qwen3-8B": "Qwen3, 8B",
    "Qwen/Qwen3-4B": "Qwen3, 4B",
    "Qwen/Qwen3-1.7B": "Qwen3, 1.7B",
    "Qwen/Qwen3-0.6B": "Qwen3, 0.6B",
    "demo/qwen-v1-tiny": "built-in demo: Qwen v1 format, random weights (meaningless text)",
    "demo/qwen2-tiny": "built-in demo: Qwen2 format, random weights (meaningless text)",
}
DEFAULT_DEMO = "demo/qwen-v1-tiny"
# Models `--model auto` picks on a GPU when their weights are already in the local HF cache.
AUTO_PREFERENCE = ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen-7B-Chat", "Qwen/Qwen3-8B")
HUB_FILES = ["*.json", "*.safetensors", "*.tiktoken", "tokenizer.model", "merges.txt", "vocab.json"]


def cache_dir() -> Path:
    """Our own cache (demo models, later engines): $STUDIO_CACHE or ~/.cache/ai-studio."""
    return Path(os.environ.get("STUDIO_CACHE") or Path.home() / ".cache" / "ai-studio")


def data_dir() -> Path:
    """Where the user's own data (conversations) lives, the platform's user data folder: $STUDIO_DATA,
    else $XDG_DATA_HOME/ai-studio or ~/.local/share/ai-studio (Linux), ~/Library/Application
    Support/ai-studio (macOS), %APPDATA%\\ai-studio (Windows)."""
    if os.environ.get("STUDIO_DATA"):
        return Path(os.environ["STUDIO_DATA"])
    if sys.platform == "win32":
        return Path(os.environ.get("APPDATA") or Path.home() / "AppData" / "Roaming") / "ai-studio"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "ai-studio"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "ai-studio"


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    model_id: str
    path: Path | None  # None: not fetched yet (only from `locate`)
    source: str  # "local folder" | "built-in demo" | "Hugging Face cache" | "download"

    @property
    def is_demo(self) -> bool:
        return self.model_id in DEMO_MODELS


def _hub_cached(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return path if (path / "config.json").is_file() else None


def locate(model_id: str, weights: Path | None = None) -> ResolvedModel:
    """Where `model_id` would come from, without building or downloading anything (for --check)."""
    if weights is not None:
        if not Path(weights).is_dir():
            raise UserError(f"--weights {weights} is not a folder")
        return ResolvedModel(model_id, Path(weights), "local folder")
    if Path(model_id).is_dir():
        return ResolvedModel(model_id, Path(model_id), "local folder")
    if model_id in DEMO_MODELS:
        return ResolvedModel(model_id, None, "built-in demo")
    if model_id.count("/") != 1:
        raise UserError(f"unknown model {model_id!r}: give a hub id like Qwen/Qwen2.5-7B-Instruct or a folder")
    cached = _hub_cached(model_id)
    return ResolvedModel(model_id, cached, "Hugging Face cache") if cached else ResolvedModel(model_id, None, "download")


def resolve(model_id: str, weights: Path | None = None) -> ResolvedModel:
    """Like `locate`, then build the demo or download from the hub where needed."""
    found = locate(model_id, weights)
    if found.path is not None:
        return found
    if found.is_demo:
        return dataclasses.replace(found, path=demo_model_dir(model_id, cache_dir()))
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(model_id, allow_patterns=HUB_FILES)
    except Exception as e:  # offline, gated, missing repo: all end the same way for the user
        raise UserError(f"could not download {model_id} from the Hugging Face hub ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no details'}); offline? download it "
                        f"elsewhere and pass --weights /path/to/folder") from None
    return dataclasses.replace(found, path=Path(path))


def auto_model(has_gpu: bool) -> tuple[str, str]:
    """The model `--model auto` picks, and why."""
    if not has_gpu:
        return DEFAULT_DEMO, "no CUDA GPU: the built-in demo model (random weights) runs on the CPU"
    for model_id in AUTO_PREFERENCE:
        if _hub_cached(model_id):
            return model_id, f"CUDA GPU and {model_id} in the local Hugging Face cache"
    return DEFAULT_DEMO, ("CUDA GPU but no chat weights in the local Hugging Face cache: the demo model runs; "
                          "pass --model Qwen/Qwen2.5-7B-Instruct to download one, or --weights FOLDER")
