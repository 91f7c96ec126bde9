"""`--check`: what would run where and why, each engine's state in the cache, and the models found —
answered without loading anything."""

from __future__ import annotations

import torch

from engine_builder.build import engine_status
from engine_builder.cache import EngineCache
from engine_builder.onnx_export import minigpt4_graph, sam_graphs
from engine_builder.trtllm import unavailable as trtllm_unavailable
from engine_builder.trtllm.engine import trtllm_key
from pipeline.minigpt4.weights import CHECKPOINT, demo_vision_folder, load_vision_folder
from pipeline.models import cache_dir, locate
from pipeline.sam.model import variant_of
from pipeline.sam.weights import locate_sam
from pipeline.service.tools import default_budget, size_text
from pipeline.weights_io import read_weight_file
from studio.config import StudioConfig
from studio.memory_fit import memory_room
from studio.model_finder import ModelFinder
from studio.plan import CHAT, IMAGE_CHAT_VISION, SEGMENT, Plan
from studio.quantized_weights import quant_key


def engine_cache(config: StudioConfig) -> EngineCache:
    return EngineCache(config.engine_dir or cache_dir() / "engines", config.rebuild)


def check_engines(config: StudioConfig, plan: Plan) -> list[str]:
    """Per tool on an engine backend (and the chat's quantized weights): whether its engines are cached,
    and their verdicts, or will be built."""
    cache, lines = engine_cache(config), []
    chat = plan.backends[CHAT].backend
    found = locate(plan.model_id, config.weights) if chat in ("torch", "tensorrt") else None
    if found is not None and found.path is not None and found.path.exists():
        if chat == "torch" and config.quant in ("int8", "int4"):
            key = quant_key(found.path, config.quant, getattr(torch, plan.dtype), cache)
            lines.append(f"chat {config.quant} weights: {cache.status(key)}")
        elif chat == "tensorrt" and config.quant != "auto" and trtllm_unavailable() is None:
            key = trtllm_key(found.path, plan.dtype, config.quant, config.context, config.max_batch, 0, cache)[0]
            lines.append(f"chat TensorRT-LLM engine: {cache.status(key)}")
    if (backend := plan.backends[SEGMENT].backend) != "torch":
        path = locate_sam(plan.sam, cache_dir())[0]
        if not path.exists():
            lines.append("segment engines: will be built once the weights are there (downloaded, or made for the demo)")
        else:
            graphs = sam_graphs(variant_of(read_weight_file(path, "SAM checkpoint")))
            lines += [f"segment engines: {line}" for line in engine_status(graphs, [path], backend, plan.dtype, cache)]
    if plan.vlm is None and (backend := plan.backends[IMAGE_CHAT_VISION].backend) != "torch":
        vision_dir = config.minigpt4_vision or demo_vision_folder(cache_dir())
        ckpt = config.minigpt4_ckpt or vision_dir / CHECKPOINT
        if not ckpt.exists():
            lines.append("image chat engine: will be built once the weights are there (made, for the demo)")
        else:
            graphs = (minigpt4_graph(load_vision_folder(ckpt, vision_dir).config),)
            lines += [f"image chat engine: {line}" for line in engine_status(graphs, [ckpt, vision_dir], backend,
                                                                              plan.dtype, cache)]
    return lines


def budget_of(config: StudioConfig, device: str) -> int | None:
    """The tools' memory budget in bytes: `--gpu-memory`, else the GPU's default (none on the CPU)."""
    return int(config.gpu_memory * 2**30) if config.gpu_memory else default_budget(torch.device(device))


def models_line(config: StudioConfig, plan: Plan) -> str:
    """The models found on this machine (the Models tab's list, in one line)."""
    budget = budget_of(config, plan.device)
    entries = ModelFinder(config, plan.dtype, plan.device, budget, engine_cache(config).root).models()
    room = memory_room(budget, plan.device)
    fit = {True: ", fits", False: f", too big for the {size_text(room[0])} {room[1]}" if room else "", None: ""}
    return f"models found ({len(entries)}): " + ", ".join(
        f"{e.id} [{e.kind}, {size_text(e.disk_bytes)}{fit[e.fits(room[0] if room else None)]}]" for e in entries)


def check_report(config: StudioConfig, plan: Plan) -> str:
    return "\n".join([f"AI Studio would run {plan.model_id} on {plan.device}/{plan.dtype}"]
                     + [f"  - {n}" for n in (*(note for _, note in plan.notes), *check_engines(config, plan),
                                            models_line(config, plan))])
