"""The model manager the service and the Models tab see: what each tool runs, the models found
(`model_finder.py`), switching a tool to one, and downloading and deleting (`model_files.py`).

A switch is the composition root's own job done again for one tool: the configuration with the new
model, then that tool's specs, made by `respec` (the composition root's, handed in: this module never
imports it), handed to the tool host by `StudioService.switch`, which lets requests in flight finish
on the old model. Image chat switches to a VLM (SmolVLM, Qwen2.5-VL) or to MiniGPT-4 over a listed LLM.

A tool's first-use download (Segment's MobileSAM, Image chat's VLM) happens in its load; `first_use` is
its Cancel, which the tool loaders (`compose.tool_specs`) watch.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from pipeline.embed.embedder import BUILT_IN
from pipeline.errors import UserError
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.demo import demo_model_dir
from pipeline.minigpt4.weights import projection_width
from pipeline.models import ModelEntry, cache_dir
from pipeline.sam.weights import DEMO as SAM_DEMO
from pipeline.service.tools import Tool, ToolHost, ToolSpec
from studio.config import StudioConfig
from studio.hub_progress import FirstUseDownload
from studio.memory_fit import memory_room
from studio.model_files import ModelFiles
from studio.model_finder import ModelFinder
from studio.plan import Plan, image_chat_parts
from studio.speech_models import voice_file, whisper_folder

# The composition root's: a configuration → its plan and every tool's spec.
Respec = Callable[[StudioConfig], tuple[Plan, Sequence[ToolSpec]]]


class ModelCatalog:
    """Over the configuration and plan the app started with (each switch replaces them)."""

    def __init__(self, config: StudioConfig, plan: Plan, host: ToolHost, finder: ModelFinder, respec: Respec,
                 say: Callable[[str], None]):
        self.config, self.plan, self.host, self.finder, self._respec = config, plan, host, finder, respec
        self._started = config  # MiniGPT-4's checkpoint and vision folder, whatever image chat ran since
        self.files = ModelFiles(finder, self.in_use, say)
        self.first_use = FirstUseDownload()
        self._chosen: dict[Tool, str] = {}  # tool → the entry id it was switched to
        self._lock = threading.Lock()

    def room(self) -> tuple[int, str] | None:
        """The memory a model must fit here now (`memory_room`)."""
        return memory_room(self.host.budget, self.host.device.type)

    # ---- what runs now ------------------------------------------------------------------------

    def current(self, tool: Tool) -> str | None:
        """The model `tool` runs (None for a chat at --llm-endpoint: that server names it)."""
        if tool == Tool.CHAT and self.plan.remote_chat:
            return None
        if tool in self._chosen:
            return self._chosen[tool]
        if tool == Tool.CHAT:
            return self.plan.model_id
        fell_back = getattr(self.host.loaded(tool), "is_demo", False)  # a first-use download failed: its demo runs
        if tool == Tool.IMAGE_CHAT and self.plan.vlm is not None and not fell_back:
            return self.plan.vlm
        if tool == Tool.IMAGE_CHAT:
            return str(self.config.minigpt4_llm) if self.config.minigpt4_llm else image_chat_parts(self.config).llm_id
        return SAM_DEMO if fell_back else self.plan.sam

    def in_use(self) -> dict[str, str | None]:
        """What each part of the app runs now, by the names users read: the tools, and the models set at launch
        (`SET_AT_LAUNCH`: the documents' embedder and reranker, the speech models)."""
        embedder = BUILT_IN if self.config.embedder == "auto" else self.config.embedder
        hearing, voice = whisper_folder(self.config.stt), voice_file(self.config.voice)
        return {**{str(tool): self.current(tool) for tool in Tool}, "documents' embedder": embedder,
                "documents' reranker": None if self.config.reranker == "none" else self.config.reranker,
                "speech to text": hearing.name if hearing else None, "voice": voice.name if voice else None}

    def servable(self) -> list[str]:
        """Chat models a request may name (`/v1/models`): every LLM found, unless chat is remote."""
        return [] if self.plan.remote_chat else [e.id for e in self.finder.models() if Tool.CHAT in e.tools]

    # ---- the finder's and the files' ----------------------------------------------------------

    def models(self) -> list[ModelEntry]:
        return self.finder.models()

    def refresh(self) -> list[ModelEntry]:
        return self.finder.refresh()

    def download(self, repo_id: str, say: Callable[[str], None], cancel: threading.Event) -> Path:
        return self.files.download(repo_id, say, cancel)

    def cancel_first_use(self) -> bool:
        """Stop the first-use download a tool's load is making (that load fails, saying so); False where
        none is running."""
        return self.first_use.stop()

    def delete_plan(self, model_id: str) -> tuple[ModelEntry, str]:
        return self.files.delete_plan(model_id)

    def delete(self, model_id: str) -> str:
        return self.files.delete(model_id)

    # ---- switching ----------------------------------------------------------------------------

    def specs_for(self, tool: Tool, model_id: str) -> list[ToolSpec]:
        """The tool specs after switching `tool` to `model_id`: that tool's, and those of the tools that
        use it (image chat over the chat's LLM); the configuration and plan are replaced to match."""
        if tool == Tool.CHAT and self.plan.remote_chat:
            raise UserError("chat runs at --llm-endpoint: pick its model on that server")
        entry = self.finder.entry(model_id)
        if tool not in entry.tools:
            raise UserError(f"{model_id} cannot serve {tool}: " + (
                "image chat runs a VLM (SmolVLM, Qwen2.5-VL), or MiniGPT-4 over a LLaMA-family LLM (Vicuna, "
                "LLaMA-2-chat)" if tool == Tool.IMAGE_CHAT else f"it is a {entry.kind}"))
        if tool == Tool.CHAT:  # an entry's id is what --model, --vlm and --sam take
            config = dataclasses.replace(self.config, model=entry.id, weights=None)
        elif tool == Tool.IMAGE_CHAT and entry.kind == "VLM":
            config = dataclasses.replace(self.config, vlm=entry.id, minigpt4_ckpt=None, minigpt4_vision=None,
                                         minigpt4_llm=None)
        elif tool == Tool.IMAGE_CHAT:
            ckpt, vision_dir, llm_dir = self._image_chat_parts(entry)
            config = dataclasses.replace(self.config, minigpt4_ckpt=ckpt, minigpt4_vision=vision_dir,
                                         minigpt4_llm=llm_dir)
        else:
            config = dataclasses.replace(self.config, sam=entry.id)
        plan, made = self._respec(config)
        before = {name: self.host.spec(name) for name in self.host.names}
        specs = {s.name: s for s in made}
        changed = [tool] + [n for n, s in specs.items() if tool in s.needs or tool in before[n].needs]
        with self._lock:
            self.config, self.plan = config, plan
            self._chosen[tool] = entry.id
        return [specs[n] for n in dict.fromkeys(changed)]

    def _image_chat_parts(self, entry: ModelEntry) -> tuple[Path, Path, Path]:
        """MiniGPT-4's checkpoint and vision folder as started, with `entry`'s LLM; its projection must
        give embeddings as wide as that LLM's."""
        parts = image_chat_parts(self._started)
        folder = entry.path if entry.path is not None else demo_model_dir(entry.id, cache_dir())
        width, llm_width = projection_width(parts.ckpt), read_config(folder).hidden_size
        if width != llm_width:
            raise UserError(f"MiniGPT-4's projection makes {width}-wide embeddings but {entry.id} takes {llm_width}: "
                            f"pick the LLM its checkpoint was trained with")
        return parts.ckpt, parts.vision_dir, folder
