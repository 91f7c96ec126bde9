"""The composition root: command-line options → a running studio (the tool host, its tools' loaders and
size estimates, the backends each tool runs on, the shared-LLM rule).

`launch.py` (the browser app) and `app/cli.py` (the terminal chat) both build through `build`; tests
and benches take the same tool loaders from `tool_specs` (with a host of their own budget). This package sits above `pipeline/` and `engine_builder/` and below `app/`: nothing
here imports `app`, and nothing imports `launch`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import UserError

# The engine threads and the request threads hand the GIL around constantly; Python's default 5 ms
# switch interval would let a busy engine thread hold up a click by several of them.
GIL_SWITCH_S = 0.0005


TOOLS = ("chat", "image chat", "segment")


@dataclasses.dataclass
class Plan:
    backends: dict  # "chat", "image chat LLM" → LLM BackendChoice; "image chat vision", "segment" → vision
    device: str
    dtype: str
    model_id: str
    sam: str
    notes: list[str]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="AI Studio: local chat, image chat and segmentation.")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--model", default="auto", help="hub id (e.g. Qwen/Qwen-7B-Chat), a hub GGUF repo and tag "
                                                   "(owner/repo:Q4_K_M), a .gguf file, demo/qwen-v1-tiny, "
                                                   "demo/qwen2-tiny, a folder, or auto")
    p.add_argument("--weights", type=Path, help="local folder with the model's config, tokenizer and weights")
    p.add_argument("--models-dir", type=Path, help="a folder of models (model folders, GGUF files, SAM .pth files) "
                                                     "the Models tab lists and switches to, beside the HF cache")
    p.add_argument("--llm-endpoint", metavar="URL", help="chat through this OpenAI-compatible server's /v1 (vLLM, "
                   "trtllm-serve, another AI Studio) instead of a local model; image chat and segment stay local")
    p.add_argument("--llm-model", help="the model to ask for at --llm-endpoint (default: the first it lists)")
    p.add_argument("--llm-api-key", help="the key --llm-endpoint asks for, if any")
    p.add_argument("--sam", default="auto", help="sam_vit_h, sam_vit_l, sam_vit_b, demo/sam-tiny, a .pth file, "
                                                 "or auto (vit_h on a GPU when cached, else the demo)")
    p.add_argument("--minigpt4-ckpt", type=Path, help="MiniGPT-4 checkpoint (prerained_minigpt4_7b.pth, holds llama_proj)")
    p.add_argument("--minigpt4-vision", type=Path, help="folder with eva_vit_g.pth + blip2_pretrained_flant5xxl.pth, "
                                                         "or a transformers BLIP-2 folder")
    p.add_argument("--minigpt4-llm", type=Path, help="the Vicuna / LLaMA-2-chat transformers folder MiniGPT-4 uses")
    p.add_argument("--minigpt4-template", choices=["vicuna_v0", "llama2"], default="vicuna_v0")
    backends = ["auto", "torch", "onnxruntime", "tensorrt"]
    p.add_argument("--backend", choices=backends, default="auto",
                   help="engines for the vision networks (SAM, MiniGPT-4's encoder); LLMs run on TensorRT-LLM "
                        "under tensorrt/auto where it imports, else on torch")
    for tool in TOOLS:
        p.add_argument(f"--{tool.replace(' ', '-')}-backend", choices=backends, help=f"override --backend for {tool}")
    p.add_argument("--quant", choices=["auto", "none", "int8", "int4"], default="auto",
                   help="LLM weights: int8, int4 (groups of 128) or none (--dtype); auto picks the first that fits "
                        "the GPU memory (float weights on the CPU). Quantized weights are cached after the first launch")
    p.add_argument("--engine-dir", type=Path, help="where built engines are cached (default: <cache>/engines)")
    p.add_argument("--data-dir", type=Path, help="where conversations are kept (default: the platform's user data "
                                                   "folder, e.g. ~/.local/share/ai-studio; $STUDIO_DATA)")
    p.add_argument("--rebuild", action="store_true", help="build every engine again instead of loading the cache")
    p.add_argument("--build-engines", action="store_true",
                   help="load every tool (building missing engines), report, and exit without serving")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--context", type=int, default=8192, help="context window in tokens per conversation")
    p.add_argument("--max-batch", type=int, default=8, choices=[1, 2, 4, 8, 16, 32],
                   help="conversations the chat engine decodes together (more wait their turn)")
    p.add_argument("--gpu-memory", type=float, metavar="GiB",
                   help="memory the tools may take together (default: the GPU's minus 2 GiB; no limit on the CPU); "
                        "the least recently used idle tool is unloaded to make room, and reloads when used")
    p.add_argument("--preload", action="store_true", help="load every tool at start-up instead of on first use")
    p.add_argument("--share", action="store_true", help="also serve through a public Gradio link")
    p.add_argument("--api-key", help="key the OpenAI-compatible API (/v1) asks for (default: none on 127.0.0.1, a "
                                     "random one, printed, when served elsewhere)")
    p.add_argument("--allow-file-urls", action="store_true",
                   help="let API requests name images as file:// URLs on this machine")
    p.add_argument("--max-upload", default="50mb", help="largest file a browser may upload (default 50mb)")
    p.add_argument("--keep-files", type=int, default=3600, metavar="SECONDS",
                   help="delete uploads, masks and exports this long after they were made (default 3600)")
    p.add_argument("--no-browser", action="store_true", help="do not open the browser on the app")
    p.add_argument("--max-sessions", type=int, default=1000,
                   help="browser tabs and API clients whose server-side state is kept (least recently used "
                        "dropped first; ~180 KB each; default 1000)")
    p.add_argument("--session-idle", type=int, default=3600, metavar="SECONDS",
                   help="drop a session's server-side state after this long unused (default 3600)")
    p.add_argument("--auth", action="append", metavar="USER:PASSWORD",
                   help="require signing in; give it once per user (each sees only their own conversations)")
    p.add_argument("--check", action="store_true", help="print what would run where and why, then exit")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    import torch

    from studio.backends import BackendChoice, choose_llm_backend, choose_vision_backend
    from pipeline.models import CHAT_MODELS, auto_model, cache_dir, locate
    from pipeline.sam.weights import DEMO as SAM_DEMO
    from pipeline.sam.weights import locate_sam

    notes = []
    has_gpu = torch.cuda.is_available()
    device = ("cuda" if has_gpu else "cpu") if args.device == "auto" else args.device
    kind, _, index = device.partition(":")
    if device != "cpu" and (kind != "cuda" or not (index.isdigit() or index == "")):
        raise UserError(f"--device {device}: use auto, cpu, cuda or cuda:N")
    if kind == "cuda" and int(index or 0) >= (count := torch.cuda.device_count() if has_gpu else 0):
        raise UserError(f"--device {device}: PyTorch sees {count} CUDA GPU(s) (torch {torch.__version__})")
    notes.append(f"device {device}: " + (f"{torch.cuda.get_device_name(device)}" if device.startswith("cuda")
                                         else "no CUDA GPU found" if args.device == "auto" else "asked for"))
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    backends = {}
    for tool in TOOLS:
        requested = getattr(args, f"{tool.replace(' ', '_')}_backend") or args.backend
        if tool != "segment":
            backends[f"{tool} LLM" if tool == "image chat" else tool] = choose_llm_backend(requested, device)
        if tool != "chat":
            backends[f"{tool} vision" if tool == "image chat" else tool] = choose_vision_backend(requested, device)
    if args.llm_endpoint:
        if not args.llm_endpoint.startswith(("http://", "https://")):
            raise UserError(f"--llm-endpoint {args.llm_endpoint}: give the server's /v1 URL, e.g. http://gpu-box:8000/v1")
        backends["chat"] = BackendChoice("remote", f"the OpenAI-compatible server at {args.llm_endpoint}; "
                                                   f"image chat and segment stay local")
    notes += [f"{part}: {choice.backend} ({choice.why})" for part, choice in backends.items()]
    notes.append(f"LLM weights: --quant {args.quant}" + (
        " (at load: float where the weights fit the free memory, else int8, else int4)" if args.quant == "auto" else ""))
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        raise UserError(f"--gpu-memory {args.gpu_memory}: give the GiB the tools may use, e.g. --gpu-memory 20")
    if args.llm_endpoint:
        model_id = args.llm_model or "(the server's first model)"
    elif args.model == "auto" and args.weights is None:
        model_id, why = auto_model(device.startswith("cuda"))
        notes.append(f"model {model_id}: {why}")
    else:
        model_id = args.model if args.model != "auto" else str(args.weights)
        if model_id not in CHAT_MODELS and not Path(model_id).is_dir() and args.weights is None:
            notes.append(f"model {model_id}: not in the registry, trying it as a hub id")
    if not args.llm_endpoint:
        found = locate(model_id, args.weights)
        notes.append(f"weights: {found.source}" + (f" ({found.path})" if found.path else ""))
    sam = args.sam
    if sam == "auto":
        cached = locate_sam("sam_vit_h", cache_dir())[1] == "cache"
        sam = "sam_vit_h" if device.startswith("cuda") and cached else SAM_DEMO
        notes.append(f"segment model {sam}: " + ("CUDA GPU and the checkpoint in the cache" if sam != SAM_DEMO else
                     "the built-in demo SAM (random weights); pass --sam sam_vit_h to download the real one"))
    notes.append(f"segment weights: {locate_sam(sam, cache_dir())[1]}")
    parts = [args.minigpt4_ckpt, args.minigpt4_vision, args.minigpt4_llm]
    if any(parts) and not all(parts):
        raise UserError("image chat needs all three of --minigpt4-ckpt, --minigpt4-vision and --minigpt4-llm")
    for part in filter(None, parts):
        if not part.exists():
            raise UserError(f"{part} does not exist")
    notes.append("image chat: MiniGPT-4 from the given files" if all(parts) else
                 "image chat: the built-in demo MiniGPT-4 (random weights); pass --minigpt4-* for the real one")
    return Plan(backends, device, dtype, model_id, sam, notes)


def image_chat_parts(args: argparse.Namespace) -> tuple[Path, Path, Path, str, bool]:
    """(MiniGPT-4 checkpoint, vision folder, LLM folder, LLM name, is_demo): the given files, or the
    demo built into the cache."""
    from pipeline.minigpt4.weights import DEMO_LLM, demo_parts
    from pipeline.models import cache_dir

    if args.minigpt4_ckpt:
        return args.minigpt4_ckpt, args.minigpt4_vision, args.minigpt4_llm, args.minigpt4_llm.name, False
    return *demo_parts(cache_dir()), DEMO_LLM, True


def engine_options(args: argparse.Namespace, echo: bool = True):
    from engine_builder.build import EngineOptions, StartupReport
    from engine_builder.cache import EngineCache
    from pipeline.models import cache_dir

    return EngineOptions(EngineCache(args.engine_dir or cache_dir() / "engines", args.rebuild), StartupReport(echo))


def check_engines(args: argparse.Namespace, plan: Plan) -> list[str]:
    """For `--check`: per tool on an engine backend (and the chat's quantized weights), whether its
    engines are cached, and their verdicts, or will be built."""
    import torch

    from engine_builder.build import engine_status
    from engine_builder.onnx_export import minigpt4_graph, sam_graphs
    from engine_builder.trtllm import unavailable as trtllm_unavailable
    from pipeline.minigpt4.weights import CHECKPOINT, demo_vision_folder, load_vision_folder
    from pipeline.models import cache_dir, locate
    from pipeline.sam.model import variant_of
    from pipeline.sam.weights import locate_sam
    from pipeline.weights_io import read_weight_file

    cache, lines = engine_options(args, echo=False).cache, []
    chat = plan.backends["chat"].backend
    found = locate(plan.model_id, args.weights) if chat in ("torch", "tensorrt") else None
    if found is not None and found.path is not None and found.path.exists():
        if chat == "torch" and args.quant in ("int8", "int4"):
            from studio.quantized_weights import quant_key

            key = quant_key(found.path, args.quant, getattr(torch, plan.dtype), cache)
            lines.append(f"chat {args.quant} weights: {cache.status(key)}")
        elif chat == "tensorrt" and args.quant != "auto" and trtllm_unavailable() is None:
            from engine_builder.trtllm.engine import trtllm_key

            key = trtllm_key(found.path, plan.dtype, args.quant, args.context, args.max_batch, 0, cache)[0]
            lines.append(f"chat TensorRT-LLM engine: {cache.status(key)}")
    if (backend := plan.backends["segment"].backend) != "torch":
        path = locate_sam(plan.sam, cache_dir())[0]
        if not path.exists():
            lines.append("segment engines: will be built once the weights are there (downloaded, or made for the demo)")
        else:
            graphs = sam_graphs(variant_of(read_weight_file(path, "SAM checkpoint")))
            lines += [f"segment engines: {line}" for line in engine_status(graphs, [path], backend, plan.dtype, cache)]
    if (backend := plan.backends["image chat vision"].backend) != "torch":
        vision_dir = args.minigpt4_vision or demo_vision_folder(cache_dir())
        ckpt = args.minigpt4_ckpt or vision_dir / CHECKPOINT
        if not ckpt.exists():
            lines.append("image chat engine: will be built once the weights are there (made, for the demo)")
        else:
            graphs = (minigpt4_graph(load_vision_folder(ckpt, vision_dir).config),)
            lines += [f"image chat engine: {line}" for line in engine_status(graphs, [ckpt, vision_dir], backend,
                                                                              plan.dtype, cache)]
    return lines


def weights_size(*paths: Path | None, dtype=None) -> int:
    """Bytes of the weight files at `paths` (files, or folders of them): a tool's size before its first
    load; with `dtype`, their floats counted at that width (how the loaders hold them)."""
    from engine_builder.fingerprint import weight_files
    from pipeline.weights_io import loaded_bytes

    existing = [p for p in paths if p is not None and Path(p).exists()]
    return sum(loaded_bytes(f, dtype) if dtype is not None else f.stat().st_size for f in weight_files(existing))


def llm_size(folder: Path | None, quant: str, dtype) -> int:
    """An LLM's size before its first load: its weight files, or with `--quant int8|int4` the quantized
    weights' bytes (a 13.5 GB bf16 Vicuna takes 3.9 GB in int4, and the budget must see that); an
    AWQ/GPTQ folder's are int4 whatever `quant` says."""
    if folder is None or not (Path(folder) / "config.json").exists():
        return weights_size(folder, dtype=dtype)
    from studio.backends import weight_bytes
    from pipeline.llm.checkpoint import read_config

    try:
        config = read_config(Path(folder))
        mode = "int4" if config.quantization else quant
        if mode in ("int8", "int4") or config.gguf_type:  # a GGUF file's size on disk is not its loaded size
            return weight_bytes(config, mode if mode in ("int8", "int4") else "none", dtype)
    except Exception:  # noqa: BLE001 - a config the loader will refuse with its own message
        pass
    return weights_size(folder, dtype=dtype)


SMALL_MODEL_NOTICE = ("**Small model.** SmolLM2-135M-Instruct (135 M parameters, the model that comes with the app) "
                      "is answering: real answers, fast on a laptop, but often wrong. For better ones start with "
                      "`--model Qwen/Qwen2.5-7B-Instruct`, a `.gguf` file you have, or `--weights FOLDER`.")
IMAGE_QUERIES = 32  # MiniGPT-4's query embeddings per image (BLIP-2's Q-Former, every checkpoint)


def tool_specs(args: argparse.Namespace, plan: Plan, engines, host) -> list:
    """How each tool loads (warm-up included: first kernels and graph captures happen in the load,
    not on a user's first request)."""
    import numpy as np
    import torch

    from pipeline.pipelines.chat import ChatPipeline
    from studio.backends import load_language_model, sam_engine, vision_encoder
    from pipeline.pipelines.image_chat import ImageChatPipeline
    from pipeline.llm.sampling import SamplingParams
    from pipeline.minigpt4.weights import load_vision_folder
    from pipeline.models import EMBEDDED, cache_dir, locate, resolve
    from pipeline.sam.model import load_sam
    from pipeline.sam.weights import DEMO as SAM_DEMO
    from pipeline.sam.weights import locate_sam, resolve_sam
    from pipeline.pipelines.segment import SegmentPipeline
    from pipeline.service.tools import ToolSpec

    dtype = getattr(torch, plan.dtype)
    remote = plan.backends["chat"].backend == "remote"
    chat_model = None if remote else locate(plan.model_id, args.weights)
    ckpt, vision_dir, llm_dir, llm_id, image_demo = image_chat_parts(args)
    # Image chat over the same weights shares the chat's LLM, which then needs room for image
    # embeddings: a TensorRT-LLM engine is built with a prompt table for them.
    shared = chat_model is not None and chat_model.path is not None and \
        Path(llm_dir).resolve() == chat_model.path.resolve()

    def load_chat(say, free):
        with engines.report.listening(say):
            if remote:
                from pipeline.llm.remote import RemoteLanguageModel

                chat = ChatPipeline(RemoteLanguageModel(args.llm_endpoint, args.llm_model, args.llm_api_key))
                engines.report.say(f"chat: {chat.description}")
                return chat
            model = resolve(plan.model_id, args.weights)
            chat = ChatPipeline(load_language_model(model.path, plan.model_id, plan.backends["chat"].backend,
                                                    plan.device, dtype, args.context, args.max_batch, engines=engines,
                                                    quant=args.quant, free_bytes=free,
                                                    image_queries=IMAGE_QUERIES if shared else 0),
                               is_demo=model.is_demo)
            warm_up = [{"role": "user", "content": "Hi"}]
            for turn in range(2):  # first kernels, graph capture and a follow-up turn's prefill happen now
                reply = "".join(e.text for e in chat.stream(warm_up, SamplingParams(max_new_tokens=2, temperature=0),
                                                            session="warm-up"))
                warm_up += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
            engines.report.say(f"chat: {chat.description}")
            return chat

    def load_segment(say, free):
        with engines.report.listening(say):
            sam_path = resolve_sam(plan.sam, cache_dir())
            sam = load_sam(sam_path, device=plan.device, dtype=dtype)
            segment = SegmentPipeline(sam_engine(sam, plan.backends["segment"].backend, sam_path, engines),
                                      is_demo=plan.sam == SAM_DEMO)
            del sam  # the engine holds what it needs (a built engine needs no torch module)
            segment.set_image(np.zeros((64, 64, 3), dtype=np.uint8))  # first kernels now, not on a click
            engines.report.say(f"segment: {segment.description}")
            return segment


    def load_image_chat(say, free):
        with engines.report.listening(say):
            encoder = vision_encoder(load_vision_folder(ckpt, vision_dir, plan.device, dtype),
                                     plan.backends["image chat vision"].backend, [ckpt, vision_dir], engines)
            if shared:
                llm = host.loaded("chat").llm
                engines.report.say("image chat: shares the chat tool's LLM (the same weights)")
            else:
                llm = load_language_model(llm_dir, llm_id, plan.backends["image chat LLM"].backend, plan.device, dtype,
                                          max_context=2048, max_batch=args.max_batch, engines=engines,
                                          quant=args.quant, image_queries=encoder.config.num_query_tokens,
                                          free_bytes=free)
            image_chat = ImageChatPipeline(encoder, llm, args.minigpt4_template, is_demo=image_demo,
                                           owns_llm=not shared)
            image_chat.encode_image(np.zeros((224, 224, 3), dtype=np.uint8))  # warm-up (captures the GPU graph)
            engines.report.say(f"image chat: {image_chat.description}")
            return image_chat

    return [ToolSpec("chat", load_chat, 0 if remote else llm_size(chat_model.path, args.quant, dtype),
                     is_demo=not remote and chat_model.is_demo,
                     notice=SMALL_MODEL_NOTICE if plan.model_id == EMBEDDED else ""),
            ToolSpec("image chat", load_image_chat,
                     weights_size(ckpt, vision_dir, dtype=dtype) + (0 if shared else llm_size(llm_dir, args.quant, dtype)),
                     needs=("chat",) if shared else (), is_demo=image_demo),
            ToolSpec("segment", load_segment, weights_size(locate_sam(plan.sam, cache_dir())[0], dtype=dtype),
                     is_demo=plan.sam == SAM_DEMO)]


def models_line(args: argparse.Namespace, plan: Plan) -> str:
    """For `--check`: the models found on this machine (the Models tab's list, in one line)."""
    import torch

    from pipeline.service.tools import ToolHost, default_budget, size_text
    from studio.model_catalog import ModelCatalog

    device = torch.device(plan.device)
    budget = int(args.gpu_memory * 2**30) if args.gpu_memory else default_budget(device)
    entries = ModelCatalog(args, plan, engine_options(args, echo=False), ToolHost(device, budget, print),
                           print).find()
    return f"models found ({len(entries)}): " + ", ".join(
        f"{e.id} [{e.kind}, {size_text(e.disk_bytes)}" + ({True: ", fits", False: ", too big for the budget",
                                                                  None: ""}[e.fits(budget)]) + "]" for e in entries)


def check_report(args: argparse.Namespace, plan: Plan) -> str:
    """For `--check`: what would run where, and why, and the models found."""
    return "\n".join([f"AI Studio would run {plan.model_id} on {plan.device}/{plan.dtype}"]
                     + [f"  - {n}" for n in plan.notes + check_engines(args, plan) + [models_line(args, plan)]])


def build(args: argparse.Namespace, plan: Plan, echo: bool = True, say: Callable[[str], None] | None = None):
    """The studio service for `plan`, every tool added to its host (none loaded yet), its start-up
    report the engines' report. `echo`: the report prints its lines (the browser app); `say`: where
    lines go instead."""
    import torch

    from pipeline.models import data_dir
    from pipeline.service.store import ConversationStore
    from pipeline.service.studio import StudioService
    from pipeline.service.tools import GIB, ToolHost, default_budget
    from studio.model_catalog import ModelCatalog

    engines = engine_options(args, echo=echo)
    say = say or engines.report.say
    for note in plan.notes:
        say(note)
    sys.setswitchinterval(GIL_SWITCH_S)
    device = torch.device(plan.device)
    budget = int(args.gpu_memory * GIB) if args.gpu_memory else default_budget(device)
    host = ToolHost(device, budget, say)
    say("memory budget: " + (f"{budget / GIB:.1f} GiB; tools load on first use and the least recently used idle "
                             "one is unloaded to make room" if budget else "none on the CPU; tools load on first use"))
    for spec in tool_specs(args, plan, engines, host):
        host.add(spec)
    store = ConversationStore(args.data_dir or data_dir())
    say(store.notice or f"conversations: {store.path}")
    return StudioService(host, engines.report.lines, store=store, catalog=ModelCatalog(args, plan, engines, host, say))


def run(argv: list[str], start: Callable[[argparse.Namespace, Plan], int]) -> int:
    """A front end's `main`: parse the options, plan, answer `--check`, then `start(args, plan)`; a
    `UserError` ends in one line (exit 2), Ctrl+C quietly (130)."""
    args = parse_args(argv)
    try:
        plan = make_plan(args)
        if args.check:
            print(check_report(args, plan))
            return 0
        return start(args, plan)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n[studio] stopped", file=sys.stderr)
        return 130
