"""Which models this machine has, and what each would take here: the Models tab's list.

Where models are found: the Hugging Face cache (what `--model` downloads and the Models tab fetches), a
`--models-dir` (folders with a config.json, SAM `.pth` files, GGUF files loose or in folders), our own
cache (SAM checkpoints, the built-in demos), the SmolLM2 GGUF file that comes with the app, and the
weights named by cached engines. A folder whose config.json names a VLM (SmolVLM, Qwen2.5-VL) is Image
chat's; a sentence-transformers folder is an embedder and a one-score classifier a reranker (the documents'
models, the built-in all-MiniLM-L6-v2 among them); Segment's and Image chat's defaults, and `--embedder` and
`--reranker`, are listed before their first-use download. Each entry says
what a user needs to pick: family, parameters, size on disk, a GGUF file's quantization, the precision it
would run in, the GPU memory that takes (weights plus one conversation's KV cache; a VLM's weights) and
whether that fits the budget.

A GGUF file is one entry per model (the parts of a split one together), under the id `--model` takes:
`owner/repo:TAG` in the Hugging Face cache (TAG the quantization in its file name, as Ollama's
`hf.co/owner/repo:Q4_K_M`), its path elsewhere. It is sized through the model folder `pipeline.models.locate`
makes of it (`gguf_folder.py`: built once per file), which is also what a switch to it loads.

Finding reads headers and builds decoders on the meta device, so the list is kept (`models`) and made
again only when asked (`refresh`: the Models tab's Refresh, a download, a delete).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import re
import threading
from pathlib import Path

import torch
from huggingface_hub import scan_cache_dir

from pipeline.embed.embedder import BUILT_IN, built_in_folder
from pipeline.errors import UserError
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.demo import DEMO_MODELS
from pipeline.llm.weights.gguf_file import SPLIT
from pipeline.llm.weights.gguf_folder import gguf_model_dir
from pipeline.llm.model.kv_cache import KVCache
from pipeline.models import (EMBEDDED, HUB_GGUF, ModelEntry, cache_dir, embedded_gguf, gguf_files_for_tag,
                             hub_offline)
from pipeline.sam.weights import CHECKPOINTS, DEMO, locate_sam
from pipeline.sam.weights import SIZES as SAM_SIZES
from pipeline.service.tools import Tool
from pipeline.weights_io import read_json
from studio.speech_models import voice_file, whisper_folder
from studio.backends import choose_quant
from studio.memory_fit import GGUF, weight_bytes
from studio.config import StudioConfig
from studio.sizes import weights_size
from studio.vlm import FAMILIES as VLM_FAMILIES
from studio.vlm import SIZES as VLM_SIZES
from studio.vlm import local_folder, model_name, vlm_id

CHAT, IMAGE_CHAT, SEGMENT = Tool.CHAT, Tool.IMAGE_CHAT, Tool.SEGMENT
EMBEDDER, RERANKER = "Embedder", "Reranker"  # the documents' models: kinds of entry, not tools one switches
HEARING, VOICE = "Speech to text", "Voice"  # the microphone's and the speaker's
SAM_PARAMS = {"sam_vit_h": 636_000_000, "sam_vit_l": 308_000_000, "sam_vit_b": 91_000_000, "mobile_sam": 9_808_452}
# The parts of a GGUF file's name that read as its quantization (Q4_K_M, IQ2_XXS, F16, BF16, fp16)
QUANT_NAME = re.compile(r"^(i?q\d\w*|b?fp?\d+)$", re.IGNORECASE)


def folder_bytes(path: Path) -> int:
    """Bytes on disk under `path` (a file or a folder; links into the hub's blob store followed once)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def gguf_models(files: list[Path]) -> list[Path]:
    """The GGUF models among `files`: each file, or the first part of a split one."""
    return sorted(f for f in files if f.name.endswith(".gguf") and (not (m := SPLIT.match(f.name))
                                                                     or m["no"] == "00001"))


def gguf_parts(first: Path) -> list[Path]:
    """The parts of the GGUF model whose file (first part) is `first` that are there (a link into the
    hub's blob store whose blob is gone is not)."""
    m = SPLIT.match(first.name)
    found = first.parent.glob(f"{glob.escape(m['stem'])}-[0-9][0-9][0-9][0-9][0-9]-of-{m['count']}.gguf") if m \
        else [first]
    return sorted(p for p in found if p.is_file())


def _first_use() -> str:
    """Where a model not here yet is: a download on first use, or, with no hub to reach, one once online."""
    return "not here: downloads once online" if hub_offline() else "downloads on first use"


class ModelFinder:
    """The models found, sized for this machine: `config`'s quantization and context, `dtype` on `device`,
    against the memory `budget`; `engine_root` is the engine cache (the weights its engines name count)."""

    def __init__(self, config: StudioConfig, dtype: str, device: str, budget: int | None, engine_root: Path):
        self.config, self.dtype, self.device, self.budget, self.engine_root = config, dtype, device, budget, engine_root
        self._unreadable: dict[tuple, str] = {}  # GGUF files (their parts' path, size, time) → why not
        self._found: list[ModelEntry] | None = None
        self._lock = threading.Lock()

    def models(self) -> list[ModelEntry]:
        """Every model found (the list kept since the last `refresh`)."""
        with self._lock:
            if self._found is None:
                self._found = self.find()
            return self._found

    def refresh(self) -> list[ModelEntry]:
        """Look again (files may have come or gone)."""
        with self._lock:
            self._found = None
        return self.models()

    def find(self) -> list[ModelEntry]:
        """Every model found, LLMs first, each once (by folder)."""
        found: dict[Path | str, ModelEntry] = {}

        def add(entry: ModelEntry | None) -> None:
            if entry is not None:
                found.setdefault(entry.path.resolve() if entry.path else entry.id, entry)

        for name in DEMO_MODELS:
            folder = Path(cache_dir()) / "demo" / name.split("/", 1)[1]
            add(self._llm(name, folder if (folder / "config.json").is_file() else None, "built-in demo"))
        if (embedded := embedded_gguf()) is not None:
            add(self._gguf(EMBEDDED, embedded, "built in"))
        for repo_id, folder in self._hub_cache():
            for voice in sorted(folder.rglob("*.onnx")):  # Piper voices (rhasspy/piper-voices holds many)
                if Path(f"{voice}.json").is_file():
                    add(self._speech_model(voice.stem, voice, "Hugging Face cache", VOICE))
            ggufs = self._hub_ggufs(repo_id, folder)
            for model_id, file in ggufs:
                add(self._gguf(model_id, file, "Hugging Face cache"))
            if (folder / "config.json").is_file() or not (ggufs or any(folder.rglob("*.onnx"))):
                add(self._folder(repo_id, folder, "Hugging Face cache"))
        models_dir = self.config.models_dir
        if models_dir is not None and Path(models_dir).is_dir():
            for item in sorted(Path(models_dir).iterdir()):
                if (item / "config.json").is_file():
                    add(self._folder(str(item), item, "models folder"))
                elif item.suffix in (".pth", ".pt") and item.name.startswith(("sam", "mobile_sam")):
                    add(self._sam(str(item), item, "models folder"))
                else:  # a GGUF file, or a folder of them (LM Studio's publisher/model/file.gguf too)
                    for file in gguf_models([item] if item.is_file() else [*item.glob("*.gguf"),
                                                                            *item.glob("*/*.gguf")]):
                        add(self._gguf(str(file), file, "models folder"))
        for name in (*CHECKPOINTS, DEMO):
            path, source = locate_sam(name, cache_dir())
            if path.is_file() or name == DEMO:
                add(self._sam(name, path if path.is_file() else None, source))
            elif name == "mobile_sam":  # Segment's default: what choosing it brings
                add(self._sam(name, None, f"{_first_use()} ({SAM_SIZES[name]})"))
        vlm = vlm_id(self.config, self.device)  # Image chat's (None: MiniGPT-4's)
        if vlm is not None and local_folder(vlm) is None:
            family = next((f for f in VLM_FAMILIES.values() if model_name(vlm).startswith(f)), "")
            add(self._vlm(vlm, None, family, f"{_first_use()} ({VLM_SIZES.get(vlm, 'a download')})"))
        for value, kind in ((self.config.embedder, EMBEDDER), (self.config.reranker, RERANKER)):
            if Path(value).expanduser().is_dir():
                add(self._documents_model(value, Path(value).expanduser(), "local folder", kind))
            elif value not in ("auto", "none") and not any(e.id == value for e in found.values()):
                add(self._documents_model(value, None, _first_use(), kind))
        if (built_in := built_in_folder()) is not None:
            add(self._documents_model(BUILT_IN, built_in, "built in", EMBEDDER))
        for value, kind, speech in ((self.config.stt, HEARING, whisper_folder(self.config.stt)),
                                    (self.config.voice, VOICE, voice_file(self.config.voice))):
            if speech is not None and speech.path is not None:
                add(self._speech_model(speech.name, speech.path, "built in" if value == "auto" else "given at launch",
                                       kind))
            elif speech is not None and not any(e.id == speech.name for e in found.values()):
                add(self._speech_model(speech.name, None, _first_use(), kind))
        for source in self._engine_sources():
            if source.is_dir() and (source / "config.json").is_file():
                add(self._folder(str(source), source, "behind a cached engine"))
            elif source.is_file() and source.suffix == ".pth":
                add(self._sam(str(source), source, "behind a cached engine"))
        return sorted(found.values(), key=lambda e: (e.kind != "LLM", e.source == "built-in demo", e.id))

    def entry(self, model_id: str) -> ModelEntry:
        for e in self.models():
            if e.id == model_id or (e.path is not None and str(e.path) == model_id):
                return e
        raise UserError(f"there is no model {model_id!r} here: pick one the Models tab lists, or download it first")

    def _folder(self, model_id: str, folder: Path, source: str) -> ModelEntry | None:
        """A model folder: Image chat's by its config's model_type (SmolVLM, Qwen2.5-VL), the documents' by its
        layout (a sentence-transformers folder: an embedder; a one-score classifier: a reranker), else an LLM."""
        try:
            config = read_json(folder / "config.json")
        except (OSError, UserError):  # `_llm` lists it with the reason
            config = {}
        if str((config.get("architectures") or [""])[0]).endswith("ForSequenceClassification"):
            return self._documents_model(model_id, folder, source, RERANKER)
        if (folder / "modules.json").is_file():
            return self._documents_model(model_id, folder, source, EMBEDDER)
        if (folder / "model.bin").is_file() and "alignment_heads" in config:  # faster-whisper's CTranslate2 folder
            return self._speech_model(model_id, folder, source, HEARING)
        family = VLM_FAMILIES.get(config.get("model_type"))
        return self._vlm(model_id, folder, family, source) if family else self._llm(model_id, folder, source)

    def _documents_model(self, model_id: str, folder: Path | None, source: str, kind: str) -> ModelEntry:
        """An embedder or a reranker for the documents (None: not downloaded yet): it runs in float32, its
        parameters its floats counted at one byte each."""
        if folder is None:
            return ModelEntry(model_id, kind, "", None, 0, "float32", None, source, None, ())
        try:
            family = str(read_json(folder / "config.json").get("model_type", ""))
        except (OSError, UserError):
            family = ""
        return ModelEntry(model_id, kind, family, weights_size(folder, dtype=torch.float8_e4m3fn), folder_bytes(folder),
                          "float32", weights_size(folder, dtype=torch.float32), source, folder, ())

    def _speech_model(self, model_id: str, path: Path | None, source: str, kind: str) -> ModelEntry:
        """Whisper (a CTranslate2 folder: int8 on the CPU, float16 on a GPU) or a Piper voice (an ONNX file, run by
        ONNX Runtime) (None: not downloaded yet); its memory, its weights' bytes; its parameters, counted from them."""
        hearing = kind == HEARING
        precision = ("int8" if self.device == "cpu" else "float16") if hearing else "float32 (ONNX Runtime)"
        size = folder_bytes(path) if path is not None else 0
        weights = (path / "model.bin" if hearing else path).stat().st_size if path is not None else None
        params = weights // (2 if hearing else 4) if weights else None  # faster-whisper's are float16, Piper's float32
        return ModelEntry(model_id, kind, "Whisper" if hearing else "Piper", params, size, precision, weights, source,
                          path, ())

    def _vlm(self, model_id: str, folder: Path | None, family: str, source: str) -> ModelEntry:
        """An image-chat model (None: not downloaded yet): its parameters are its floats counted at one byte
        each; the GPU memory its weights at this dtype, as the tool's size is estimated before its load."""
        if folder is None:
            return ModelEntry(model_id, "VLM", family, None, 0, self.dtype, None, source, None, (IMAGE_CHAT,))
        params = weights_size(folder, dtype=torch.float8_e4m3fn)
        return ModelEntry(model_id, "VLM", family, params, folder_bytes(folder), self.dtype,
                          weights_size(folder, dtype=getattr(torch, self.dtype)), source, folder, (IMAGE_CHAT,))

    def _llm(self, model_id: str, folder: Path | None, source: str) -> ModelEntry | None:
        if folder is None:
            return ModelEntry(model_id, "LLM", "demo (built on first use)", None, 0, self.dtype, None, source,
                              None, (CHAT,))
        try:
            config = read_config(folder)
        except Exception as e:  # noqa: BLE001 - listed, so the user sees it and can delete it
            return ModelEntry(model_id, "other", f"not supported ({str(e)[:60]})", None, folder_bytes(folder), "",
                              None, source, folder, ())
        dtype = getattr(torch, self.dtype)
        mode = choose_quant(self.config.quant, config, dtype, torch.device(self.device), self.budget,
                            self.config.context)[0]
        params = weight_bytes(config, "none", torch.float32) // 4
        on_cpu = self.device == "cpu"
        precision = self.dtype if mode == "none" else f"{mode} weights, {self.dtype}" if mode != GGUF else \
            f"{config.gguf_type} blocks as stored, " + ("ONNX Runtime" if on_cpu else self.dtype)
        need = weight_bytes(config, mode, dtype, on_cpu) + KVCache.row_bytes(config, self.config.context + 1, dtype)
        tools = (CHAT, IMAGE_CHAT) if config.family == "llama" else (CHAT,)
        return ModelEntry(model_id, "LLM", config.family, params, folder_bytes(folder), precision, need, source,
                          folder, tools, config.gguf_type)

    def _gguf(self, model_id: str, file: Path, source: str) -> ModelEntry | None:
        """The GGUF model in `file` (the first part of a split one): sized as `_llm` sizes the model folder
        `locate` makes of it, its size on disk the file's (all parts)."""
        parts = gguf_parts(file)
        if not parts or parts[0] != file:
            return None  # gone, or its first part is
        size = sum(p.stat().st_size for p in parts)
        try:
            folder = self._gguf_folder(parts)
        except Exception as e:  # noqa: BLE001 - listed, so the user sees why and can delete it
            return ModelEntry(model_id, "other", f"not supported ({str(e)[:60]})", None, size, "", None, source,
                              None, (), files=tuple(parts))
        return dataclasses.replace(self._llm(model_id, folder, source), disk_bytes=size, files=tuple(parts))

    def _gguf_folder(self, parts: list[Path]) -> Path:
        """The model folder of the GGUF model in `parts` (`gguf_folder.py`; made once, then found by its
        name). A file that cannot be read is not read again until it changes."""
        key = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in parts)
        if key in self._unreadable:
            raise UserError(self._unreadable[key])
        try:
            return gguf_model_dir(parts[0], cache_dir())
        except Exception as e:  # noqa: BLE001 - damaged, unsupported, or a part missing
            self._unreadable[key] = str(e) or type(e).__name__
            raise

    @staticmethod
    def _hub_ggufs(repo_id: str, folder: Path) -> list[tuple[str, Path]]:
        """(id, file) of each GGUF model in a hub snapshot: `repo_id:TAG`, or its path where no tag picks
        it alone."""
        files = sorted(folder.rglob("*.gguf"))
        names = [f.relative_to(folder).as_posix() for f in files]
        out = []
        for first in gguf_models(files):
            parts = [f.relative_to(folder).as_posix() for f in gguf_parts(first)]
            tag = ModelFinder._tag(first, names, parts)
            out.append((f"{repo_id}:{tag}" if tag and HUB_GGUF.match(f"{repo_id}:{tag}") else str(first), first))
        return out

    @staticmethod
    def _tag(first: Path, names: list[str], parts: list[str]) -> str | None:
        """The tag that picks just `parts` among a repository's GGUF files `names` (`gguf_files_for_tag`):
        the quantization its name holds (Q4_K_M), else the whole name."""
        stem = m["stem"] if (m := SPLIT.match(first.name)) else first.name.removesuffix(".gguf")
        words = re.split(r"[-.]", stem)
        for tag in [*(w.upper() for w in reversed(words) if QUANT_NAME.match(w)), stem]:
            try:
                if sorted(gguf_files_for_tag(names, tag)) == sorted(parts):
                    return tag
            except UserError:  # the tag picks several models
                continue
        return None

    def _sam(self, model_id: str, path: Path | None, source: str) -> ModelEntry:
        variant = next((v for v in SAM_PARAMS if v in Path(model_id).name.replace("-", "_")), "")
        size = path.stat().st_size if path is not None else 0
        need = weights_size(path, dtype=getattr(torch, self.dtype)) if path is not None else None
        return ModelEntry(model_id, "SAM", variant or ("demo" if "demo" in model_id else "SAM"),
                          SAM_PARAMS.get(variant), size, self.dtype, need, source, path, (SEGMENT,))

    @staticmethod
    def _hub_cache() -> list[tuple[str, Path]]:
        """(repo id, newest snapshot folder) of each model in the Hugging Face cache."""
        try:
            info = scan_cache_dir()
        except Exception:  # noqa: BLE001 - no cache yet, or one we cannot read: nothing found there
            return []
        out = []
        for repo in info.repos:
            if repo.repo_type == "model" and repo.revisions:
                newest = max(repo.revisions, key=lambda r: r.last_modified)
                out.append((repo.repo_id, Path(newest.snapshot_path)))
        return out

    def _engine_sources(self) -> list[Path]:
        """The weights cached engines and quantized weights were built from."""
        sources = set()
        for meta in self.engine_root.glob("*/meta.json"):
            try:
                source = json.loads(meta.read_text())["key"]["source"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            sources.update(Path(part) for part in str(source).split(", ") if part)
        return sorted(p for p in sources if p.exists())
