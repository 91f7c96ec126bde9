"""The model manager: which models this machine has, what each would take, and how a tool switches to one.

Where models are found: the Hugging Face cache (what `--model` downloads and the Models tab fetches), a
`--models-dir` (folders with a config.json, SAM `.pth` files, GGUF files loose or in folders), our own
cache (SAM checkpoints, the built-in demos), the SmolLM2 GGUF file that comes with the app, and the
weights named by cached engines. Each entry says what a user needs to pick: family, parameters, size on
disk, a GGUF file's quantization, the precision it would run in, the GPU memory that takes (weights plus
one conversation's KV cache) and whether that fits the budget.

A GGUF file is one entry per model (the parts of a split one together), under the id `--model` takes:
`owner/repo:TAG` in the Hugging Face cache (TAG the quantization in its file name, as Ollama's
`hf.co/owner/repo:Q4_K_M`), its path elsewhere. It is sized through the model folder `pipeline.models.locate`
makes of it (`gguf_folder.py`: built once per file, so a listing reads each file's header once, not at
every refresh), which is also what a switch to it loads.

A switch is the composition root's own job done again for one tool: the options with the new model,
then the tool specs, handed to the tool host (`StudioService.switch`), which lets requests in flight
finish on the old model.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import UserError
from pipeline.service.tools import size_text
from studio.hub_progress import READ_BYTES, DownloadCancelled, progress_class

CHAT, IMAGE_CHAT, SEGMENT = "chat", "image chat", "segment"
SAM_PARAMS = {"sam_vit_h": 636_000_000, "sam_vit_l": 308_000_000, "sam_vit_b": 91_000_000}
# The parts of a GGUF file's name that read as its quantization (Q4_K_M, IQ2_XXS, F16, BF16, fp16)
QUANT_NAME = re.compile(r"^(i?q\d\w*|b?fp?\d+)$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    id: str  # what --model / --sam take: a hub id, a demo name, a registry name, or a path
    kind: str  # "LLM" or "SAM"
    family: str
    params: int | None
    disk_bytes: int
    precision: str  # what it would run in here
    gpu_bytes: int | None  # weights as they would run, plus one conversation's KV cache
    source: str
    path: Path | None  # None: a demo not built yet; a GGUF model's folder (`gguf_folder.py`)
    tools: tuple[str, ...]  # the tools it can serve
    quant: str = ""  # a GGUF file's quantization (Q4_K_M), from its metadata
    files: tuple[Path, ...] = ()  # a GGUF model's file (every part of a split one), as found

    def fits(self, budget: int | None) -> bool | None:
        return None if budget is None or self.gpu_bytes is None else self.gpu_bytes <= budget


def folder_bytes(path: Path) -> int:
    """Bytes on disk under `path` (a file or a folder; links into the hub's blob store followed once)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def gguf_models(files: list[Path]) -> list[Path]:
    """The GGUF models among `files`: each file, or the first part of a split one."""
    from pipeline.llm.gguf_file import SPLIT

    return sorted(f for f in files if f.name.endswith(".gguf") and (not (m := SPLIT.match(f.name))
                                                                     or m["no"] == "00001"))


def gguf_parts(first: Path) -> list[Path]:
    """The parts of the GGUF model whose file (first part) is `first` that are there (a link into the
    hub's blob store whose blob is gone is not)."""
    from pipeline.llm.gguf_file import SPLIT

    m = SPLIT.match(first.name)
    found = first.parent.glob(f"{glob.escape(m['stem'])}-[0-9][0-9][0-9][0-9][0-9]-of-{m['count']}.gguf") if m \
        else [first]
    return sorted(p for p in found if p.is_file())


class ModelCatalog:
    def __init__(self, args: argparse.Namespace, plan, engines, host, say: Callable[[str], None]):
        """Over the options and plan the app started with (each switch updates them)."""
        self.args, self.plan, self.engines, self.host, self.say = args, plan, engines, host, say
        self._chosen: dict[str, str] = {}  # tool → the entry id it was switched to
        self._unreadable: dict[tuple, str] = {}  # GGUF files (their parts' path, size, time) → why not

    # ---- what runs now ------------------------------------------------------------------------

    def current(self, tool: str) -> str | None:
        """The model `tool` runs (None for a chat at --llm-endpoint: that server names it)."""
        from studio.compose import image_chat_parts

        if tool == CHAT and self.plan.backends["chat"].backend == "remote":
            return None
        if tool in self._chosen:
            return self._chosen[tool]
        if tool == CHAT:
            return self.plan.model_id
        if tool == IMAGE_CHAT:
            return str(self.args.minigpt4_llm) if self.args.minigpt4_llm else image_chat_parts(self.args)[3]
        return self.plan.sam

    def servable(self) -> list[str]:
        """Chat models a request may name (`/v1/models`): every LLM found, unless chat is remote."""
        if self.plan.backends["chat"].backend == "remote":
            return []
        return [e.id for e in self.find() if CHAT in e.tools]

    # ---- finding ------------------------------------------------------------------------------

    def find(self) -> list[ModelEntry]:
        """Every model found, LLMs first, each once (by folder)."""
        from pipeline.llm.demo import DEMO_MODELS
        from pipeline.models import EMBEDDED, cache_dir, embedded_gguf
        from pipeline.sam.weights import CHECKPOINTS, DEMO, locate_sam

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
            ggufs = self._hub_ggufs(repo_id, folder)
            for model_id, file in ggufs:
                add(self._gguf(model_id, file, "Hugging Face cache"))
            if not ggufs or (folder / "config.json").is_file():
                add(self._llm(repo_id, folder, "Hugging Face cache"))
        models_dir = getattr(self.args, "models_dir", None)
        if models_dir is not None and Path(models_dir).is_dir():
            for item in sorted(Path(models_dir).iterdir()):
                if (item / "config.json").is_file():
                    add(self._llm(str(item), item, "models folder"))
                elif item.suffix == ".pth" and item.name.startswith("sam"):
                    add(self._sam(str(item), item, "models folder"))
                else:  # a GGUF file, or a folder of them (LM Studio's publisher/model/file.gguf too)
                    for file in gguf_models([item] if item.is_file() else [*item.glob("*.gguf"),
                                                                            *item.glob("*/*.gguf")]):
                        add(self._gguf(str(file), file, "models folder"))
        for name in (*CHECKPOINTS, DEMO):
            path, source = locate_sam(name, cache_dir())
            if path.is_file() or name == DEMO:
                add(self._sam(name, path if path.is_file() else None, source))
        for source in self._engine_sources():
            if source.is_dir() and (source / "config.json").is_file():
                add(self._llm(str(source), source, "behind a cached engine"))
            elif source.is_file() and source.suffix == ".pth":
                add(self._sam(str(source), source, "behind a cached engine"))
        return sorted(found.values(), key=lambda e: (e.kind != "LLM", e.source == "built-in demo", e.id))

    def entry(self, model_id: str) -> ModelEntry:
        for e in self.find():
            if e.id == model_id or (e.path is not None and str(e.path) == model_id):
                return e
        raise UserError(f"there is no model {model_id!r} here: pick one the Models tab lists, or download it first")

    def _llm(self, model_id: str, folder: Path | None, source: str) -> ModelEntry | None:
        import torch

        from pipeline.llm.checkpoint import read_config
        from pipeline.llm.model import KVCache
        from studio.backends import choose_quant, weight_bytes

        if folder is None:
            return ModelEntry(model_id, "LLM", "demo (built on first use)", None, 0, self.plan.dtype, None, source,
                              None, (CHAT,))
        try:
            config = read_config(folder)
        except Exception as e:  # noqa: BLE001 - listed, so the user sees it and can delete it
            return ModelEntry(model_id, "other", f"not supported ({str(e)[:60]})", None, folder_bytes(folder), "",
                              None, source, folder, ())
        dtype = getattr(torch, self.plan.dtype)
        mode = choose_quant(self.args.quant, config, dtype, torch.device(self.plan.device), self.host.budget,
                            self.args.context)[0]
        params = weight_bytes(config, "none", torch.float32) // 4
        precision = self.plan.dtype if mode == "none" else f"{mode} weights, {self.plan.dtype}"
        need = weight_bytes(config, mode, dtype) + KVCache.row_bytes(config, self.args.context + 1, dtype)
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
        from pipeline.llm.gguf_folder import gguf_model_dir
        from pipeline.models import cache_dir

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
        from pipeline.models import HUB_GGUF

        files = sorted(folder.rglob("*.gguf"))
        names = [f.relative_to(folder).as_posix() for f in files]
        out = []
        for first in gguf_models(files):
            parts = [f.relative_to(folder).as_posix() for f in gguf_parts(first)]
            tag = ModelCatalog._tag(first, names, parts)
            out.append((f"{repo_id}:{tag}" if tag and HUB_GGUF.match(f"{repo_id}:{tag}") else str(first), first))
        return out

    @staticmethod
    def _tag(first: Path, names: list[str], parts: list[str]) -> str | None:
        """The tag that picks just `parts` among a repository's GGUF files `names` (`gguf_files_for_tag`):
        the quantization its name holds (Q4_K_M), else the whole name."""
        from pipeline.llm.gguf_file import SPLIT
        from pipeline.models import gguf_files_for_tag

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
        import torch

        from studio.compose import weights_size

        variant = next((v for v in SAM_PARAMS if v in Path(model_id).name.replace("-", "_")), "")
        size = path.stat().st_size if path is not None else 0
        need = weights_size(path, dtype=getattr(torch, self.plan.dtype)) if path is not None else None
        return ModelEntry(model_id, "SAM", variant or ("demo" if "demo" in model_id else "SAM"),
                          SAM_PARAMS.get(variant), size, self.plan.dtype, need, source, path, (SEGMENT,))

    @staticmethod
    def _hub_cache() -> list[tuple[str, Path]]:
        """(repo id, newest snapshot folder) of each model in the Hugging Face cache."""
        from huggingface_hub import scan_cache_dir

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
        for meta in Path(self.engines.cache.root).glob("*/meta.json"):
            try:
                source = json.loads(meta.read_text())["key"]["source"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            sources.update(Path(part) for part in str(source).split(", ") if part)
        return sorted(p for p in sources if p.exists())

    # ---- switching ----------------------------------------------------------------------------

    def specs_for(self, tool: str, model_id: str) -> list:
        """The tool specs after switching `tool` to `model_id`: that tool's, and those of the tools that
        use it (image chat over the chat's LLM); the options and plan are updated to match."""
        from studio.compose import make_plan, tool_specs

        if tool == CHAT and self.plan.backends["chat"].backend == "remote":
            raise UserError("chat runs at --llm-endpoint: pick its model on that server")
        entry = self.entry(model_id)
        if tool not in entry.tools:
            raise UserError(f"{model_id} cannot serve {tool}: " + (
                "image chat's LLM must be a LLaMA-family model (Vicuna, LLaMA-2-chat)" if tool == IMAGE_CHAT
                else f"it is a {entry.kind}"))
        args = argparse.Namespace(**vars(self.args))
        if tool == CHAT:  # an entry's id is what --model and --sam take
            args.model, args.weights = entry.id, None
        elif tool == IMAGE_CHAT:
            args.minigpt4_ckpt, args.minigpt4_vision, args.minigpt4_llm = self._image_chat_parts(entry)
        else:
            args.sam = entry.id
        plan = make_plan(args)
        before = {s.name: s for s in self.host_specs()}
        specs = {s.name: s for s in tool_specs(args, plan, self.engines, self.host)}
        changed = [tool] + [n for n, s in specs.items() if tool in s.needs or tool in before[n].needs]
        self.args, self.plan = args, plan
        self._chosen[tool] = entry.id
        return [specs[n] for n in dict.fromkeys(changed)]

    def host_specs(self) -> list:
        return [self.host.spec(name) for name in self.host.names]

    def _image_chat_parts(self, entry: ModelEntry) -> tuple[Path, Path, Path]:
        """MiniGPT-4's checkpoint and vision folder as started, with `entry`'s LLM; its projection must
        give embeddings as wide as that LLM's."""
        from pipeline.llm.checkpoint import read_config
        from pipeline.minigpt4.weights import projection_width
        from studio.compose import image_chat_parts

        ckpt, vision_dir, _, _, _ = image_chat_parts(self.args)
        folder = entry.path if entry.path is not None else self._built_demo(entry.id)
        width, llm_width = projection_width(ckpt), read_config(folder).hidden_size
        if width != llm_width:
            raise UserError(f"MiniGPT-4's projection makes {width}-wide embeddings but {entry.id} takes {llm_width}: "
                            f"pick the LLM its checkpoint was trained with")
        return ckpt, vision_dir, folder

    @staticmethod
    def _built_demo(model_id: str) -> Path:
        from pipeline.llm.demo import demo_model_dir
        from pipeline.models import cache_dir

        return demo_model_dir(model_id, cache_dir())

    # ---- downloading and deleting -------------------------------------------------------------

    def download(self, repo_id: str, say: Callable[[str], None], cancel: threading.Event) -> Path:
        """Fetch `repo_id`'s config, tokenizer and weights into the Hugging Face cache with huggingface_hub's
        client, progress to `say`; for `owner/repo:TAG`, just the GGUF file that tag picks (every part).
        A connection dropped mid-file resumes from the bytes it has (HTTP Range); after a cancel or a
        failure, the files already complete are kept and not fetched again."""
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HFValidationError, RepositoryNotFoundError,
                                            RevisionNotFoundError)

        from pipeline.models import HUB_FILES, HUB_GGUF, hub_gguf_files

        repo_id = (repo_id or "").strip()
        if not repo_id:
            raise UserError("type a Hugging Face model id, like Qwen/Qwen2.5-0.5B-Instruct, or a GGUF repository "
                            "and tag, like Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
        constants.DOWNLOAD_CHUNK_SIZE = READ_BYTES  # Cancel is seen once per read: 10 MiB is seconds on a slow line
        tagged = HUB_GGUF.match(repo_id)
        repo = tagged["repo"] if tagged else repo_id
        try:
            files = hub_gguf_files(repo, tagged["tag"]) if tagged else HUB_FILES
            path = Path(snapshot_download(repo, allow_patterns=files, tqdm_class=progress_class(say, cancel)))
        except UserError:
            raise
        except HFValidationError:
            raise UserError(f"{repo_id!r} is not a Hugging Face model id: it looks like owner/name (or "
                            f"owner/name:TAG for a GGUF file)") from None
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise UserError(f"there is no model {repo_id} on the hub (or it is private: sign in with "
                            f"`hf auth login`)") from None
        except GatedRepoError:
            raise UserError(f"{repo_id} is gated: accept its terms on huggingface.co and sign in with "
                            f"`hf auth login`") from None
        except DownloadCancelled:
            raise UserError(f"the download of {repo_id} was cancelled; the files already complete are kept, "
                            f"and downloading it again fetches only the rest") from None
        except Exception as e:  # offline, disk full, a dropped connection retried too often
            first = str(e).splitlines()[0] if str(e) else "no details"
            raise UserError(f"could not download {repo_id} ({type(e).__name__}: {first[:200]}); downloading "
                            f"it again fetches only the files still missing") from None
        if tagged:
            return path / files[0]
        if not (path / "config.json").is_file():
            raise UserError(f"{repo_id} has no config.json: it is not a model this app can run")
        return path

    def delete_plan(self, model_id: str) -> tuple[ModelEntry, str]:
        """What deleting `model_id` would remove, as the question asked before doing it."""
        entry = self.entry(model_id)
        for tool in (CHAT, IMAGE_CHAT, SEGMENT):
            if self._runs(entry, self.current(tool)):
                raise UserError(f"{entry.id} is the {tool} model now: switch {tool} to another model first")
        if entry.source in ("built-in demo", "built in", "behind a cached engine") or \
                entry.path is None and not entry.files:
            raise UserError(f"{entry.id} is {entry.source}: it is not a download this app manages")
        where = "the Hugging Face cache" if entry.source == "Hugging Face cache" else \
            ", ".join(map(str, entry.files)) if entry.files else str(entry.path)
        return entry, f"Delete {entry.id} ({size_text(entry.disk_bytes)}) from {where}?"

    @staticmethod
    def _runs(entry: ModelEntry, current: str | None) -> bool:
        """Whether the model a tool runs, `current` (as it was given), is `entry`'s: its id or path, or for
        a GGUF model any id that `locate` makes the same model folder of (`owner/repo:q4_k_m`)."""
        from pipeline.models import locate

        if current is None:
            return False
        if current == entry.id or (entry.path is not None and current == str(entry.path)):
            return True
        if not entry.files or entry.path is None:
            return False
        try:
            return locate(current).path == entry.path
        except Exception:  # noqa: BLE001 - a model that is not there any more is not this one
            return False

    def delete(self, model_id: str) -> str:
        """Remove `model_id`'s files (after `delete_plan` was shown and confirmed)."""
        from huggingface_hub import scan_cache_dir

        entry, _ = self.delete_plan(model_id)
        if entry.files:
            self._delete_gguf(entry)
        elif entry.source == "Hugging Face cache":
            repos = [r for r in scan_cache_dir().repos if r.repo_id == entry.id and r.repo_type == "model"]
            scan_cache_dir().delete_revisions(*[rev.commit_hash for r in repos for rev in r.revisions]).execute()
        elif entry.path.is_dir():
            shutil.rmtree(entry.path)
        else:
            entry.path.unlink()
        self.say(f"deleted {entry.id} ({size_text(entry.disk_bytes)})")
        return f"Deleted {entry.id}."

    @staticmethod
    def _delete_gguf(entry: ModelEntry) -> None:
        """Remove a GGUF model's files: in the Hugging Face cache its snapshot links and their blobs (the
        whole repository when it holds nothing else of use), elsewhere the files; then its model folder."""
        from huggingface_hub import scan_cache_dir

        from pipeline.models import cache_dir

        doomed = {p.resolve() for p in entry.files}
        if entry.source == "Hugging Face cache":
            info = scan_cache_dir()
            repos = [r for r in info.repos if any(f.blob_path in doomed for rev in r.revisions for f in rev.files)]
            files = [f for r in repos for rev in r.revisions for f in rev.files]
            if not any(f.file_name.endswith((".gguf", ".safetensors", ".bin")) for f in files
                       if f.blob_path not in doomed):
                info.delete_revisions(*[rev.commit_hash for r in repos for rev in r.revisions]).execute()
            else:
                for f in files:
                    if f.blob_path in doomed:
                        f.file_path.unlink()
                for blob in doomed:
                    blob.unlink(missing_ok=True)
        else:
            for part in entry.files:
                part.unlink()
        if entry.path is not None and entry.path.is_relative_to(cache_dir() / "gguf"):
            shutil.rmtree(entry.path, ignore_errors=True)  # its config, tokenizer files and link; made again on use
