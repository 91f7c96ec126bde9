"""The one factory that picks each tool's engine from the backend choice.

Pipelines, UI and API only see the engine seams (`LLMEngine`, the SAM and MiniGPT-4 vision
engines); a backend adds implementations here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import torch

from engine_builder import onnxruntime_backend, tensorrt_backend, trtllm
from engine_builder.build import RUNTIMES, EngineOptions, build_engines
from engine_builder.cache import EngineBuildError
from engine_builder.onnx_export import minigpt4_graph, sam_graphs
from engine_builder.trtllm.engine import load_trtllm_engine
from pipeline.minigpt4.engine import SessionVisionEncoder, TorchVisionEncoder, VisionEncoder
from pipeline.models import resolve
from pipeline.sam.engine import SessionSamEngine
from pipeline.errors import UserError
from pipeline.files import atomic_write
from pipeline.llm.model.loading import empty_decoder, load_decoder, load_gguf_native
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.weights.gguf_native import KINDS as GGUF_KINDS, GGUFLinear, unavailable as gguf_unavailable
from pipeline.llm.draft_model import DraftModel
from pipeline.llm.engine.speculation import prompt_lookup
from pipeline.llm.model.invariant import make_batch_invariant
from pipeline.llm.engine.torch_engine import TorchLLMEngine
from pipeline.llm.language_model import LanguageModel
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.weights.quant import (MODES, QuantLinear, empty_quantized, kernel_stand_ins, kernel_unavailable,
                                        use_kernels)
from studio.draft_choice import draft_modes, fastest_draft, record_name, same_vocabulary
from studio.onnx_llm import onnx_gguf_decoder, unavailable as onnx_unavailable
from studio.memory_fit import GGUF, available_memory, check_memory, weight_bytes
from studio.quantized_weights import quantized_decoder
from pipeline.llm.engine.params import SamplingParams, checkpoint_defaults
from pipeline.llm.text.tokenizer import load_tokenizer
from pipeline.minigpt4.vision import MiniGPT4Vision
from pipeline.sam.engine import SamEngine, torch_sam_engine
from pipeline.sam.model import Sam
from plugins.precompile import compile_steps, model_calls, settle
from plugins.lowbit_tuning import CANDIDATES_WHAT, TunedConfigs, compile_ahead

VISION_BACKENDS = ("torch", "onnxruntime", "tensorrt")
KV_SHARE_OF_FREE_MEMORY = 0.4  # of what is free (on the GPU, or under the budget) once the weights are in


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    backend: str  # "torch", "onnxruntime", "tensorrt" (TensorRT for vision, TensorRT-LLM for LLMs)
    why: str


def choose_vision_backend(requested: str, device: str) -> BackendChoice:
    """What runs a vision network for `--backend` `requested` on `device`, and why. `auto` takes
    TensorRT where it imports and a GPU is present, else torch: CUDA graphs on a GPU, and eager on the
    CPU, where it measured faster than ONNX Runtime's engines (bench/RESULTS.md, engine_build). A
    backend asked for but unable to run here falls back to torch, saying why."""
    if requested == "torch":
        return BackendChoice("torch", "asked for")
    if requested == "onnxruntime":
        missing = onnxruntime_backend.unavailable()
        return BackendChoice("onnxruntime", "asked for") if missing is None else \
            BackendChoice("torch", f"instead of ONNX Runtime: {missing}")
    on_gpu = device.startswith("cuda")
    missing = tensorrt_backend.unavailable() if on_gpu else "no CUDA GPU"
    if missing is None:
        return BackendChoice("tensorrt", "TensorRT imports and a CUDA GPU is present")
    how = "CUDA graphs on the GPU" if on_gpu else "eager on the CPU, faster there than ONNX Runtime's engines"
    return BackendChoice("torch", f"{how}, instead of TensorRT: {missing}")


def choose_llm_backend(requested: str, device: str) -> BackendChoice:
    """TensorRT-LLM under `tensorrt`/`auto` where it imports and a GPU is present, else torch."""
    if requested in ("torch", "onnxruntime"):
        return BackendChoice("torch", "asked for" if requested == "torch" else "ONNX Runtime runs no LLMs here")
    missing = trtllm.unavailable() if device.startswith("cuda") else "no CUDA GPU"
    if missing is None:
        return BackendChoice("tensorrt", "TensorRT-LLM imports and a CUDA GPU is present")
    return BackendChoice("torch", f"instead of TensorRT-LLM: {missing}")


CPU_KV_CACHE_BYTES = 2 << 30


def cache_rows(config, context: int, dtype: torch.dtype, max_batch: int, kv_cache_bytes: int | None) -> tuple[int, int]:
    """(cache rows, batch) that fit the KV budget (None: the CPU, where `CPU_KV_CACHE_BYTES` bounds it: 16
    rows of SmolLM2's 8k context would take 6 GiB of a laptop's memory): twice the batch where memory
    allows, so idle sessions keep their turns; the batch shrinks (to a power of two) where it does not."""
    row = KVCache.row_bytes(config, context + 1, dtype)
    if kv_cache_bytes is None:
        kv_cache_bytes = max(row, min(2 * max_batch * row, CPU_KV_CACHE_BYTES))
    rows = min(2 * max_batch, kv_cache_bytes // row)
    if rows < 1:
        raise UserError(f"not enough memory left to hold one {context}-token conversation (the model's "
                        f"memory of it, its KV cache, takes {row / 2**30:.1f} GiB): lower --context")
    batch = 1 << (min(max_batch, rows).bit_length() - 1)
    return rows, batch


EXACT_INT4 = frozenset({"Q4_0", "Q4_1"})  # 4-bit blocks of 32 that int4 keeps as they are (`quant.int4_grid`)


def gguf_modes(config) -> tuple[tuple[str, ...], str]:
    """The weight modes `--quant auto` tries on a GPU for a GGUF file, in order, and why (on the CPU it takes the
    first only where that is int4: `choose_quant`). A file whose every type
    has a kernel (`gguf_native.KINDS`: the K types Q4_K/Q5_K/Q6_K, Q8_0 and the 4- and 5-bit blocks of 32) runs
    as stored first: about its own size, bit for bit its own weights, and faster than llama.cpp on the same file
    (a Qwen2.5-7B-shape Q4_K_M: 320 tok/s, 1.70× llama.cpp's, H200: bench/RESULTS.md); int8 (twice the memory)
    and int4 (re-rounded) follow where it cannot. By measured quality:
    Q4_0 and Q4_1 blocks are int4's own groups of 32, kept as they are (`int4_grid`; SmolLM2's Q4_1 on the
    kernels: perplexity 11.642, int8 11.677, float 11.556, H200 bf16); every other quantized file (5-, 6-,
    8-bit, Q4_K, whose 6-bit sub-scales int4 would re-round, the IQ types, and the mixes) runs as int8 where
    it has a type without a kernel, which carries it within 0.1 % of its perplexity (re-rounding a real
    Qwen2.5-0.5B Q4_K_M into int4 cost +9.25 %, bench/RESULTS.md). A float GGUF file: as a float checkpoint
    (`MODES`)."""
    types = set(config.gguf_tensor_types) - {"F32", "F16", "BF16"}
    if not types:
        return MODES, ""
    if types <= EXACT_INT4 and len(types) == 1:
        return ("int4",), f"its {next(iter(types))} blocks of 32 run as int4 as they are"
    if types <= GGUF_KINDS:
        return (GGUF, "int8", "int4"), (
            f"a {config.gguf_type} file: its {', '.join(sorted(types))} blocks run as the file stores them, in about "
            f"its size, exactly its weights (--quant int8 to insist on int8: twice the memory)")
    return ("int8", "int4"), (f"a {config.gguf_type} file holds {', '.join(sorted(types))} weights: int8 carries "
                              f"them within 0.1 % of their perplexity, int4 would re-round them (--quant int4 to "
                              f"insist)")


def gguf_asked(config, dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    """`--quant gguf` for a GGUF file: its blocks as stored where they can run so, else the nearest mode, saying
    why."""
    types = set(config.gguf_tensor_types) - {"F32", "F16", "BF16"}
    if device.type == "cpu":
        why = onnx_unavailable(config)
        return (GGUF, "asked for") if why is None else ("none", f"--quant gguf cannot run here ({why}): running it as none")
    why = gguf_unavailable(device, dtype, types & GGUF_KINDS) or (
        f"its {', '.join(sorted(types - GGUF_KINDS))} blocks have no kernel" if types - GGUF_KINDS else None)
    if why is None:
        return GGUF, "asked for"
    fallback = "int8" if device.type == "cuda" else "none"
    return fallback, f"--quant gguf cannot run here ({why}): running it as {fallback}"


def choose_quant(requested: str, config, dtype: torch.dtype, device: torch.device, free_bytes: int | None,
                 context: int) -> tuple[str, str]:
    """The weight mode for `--quant requested`, and why. `auto` on the CPU runs a quantized GGUF file's blocks as
    stored on ONNX Runtime (`studio/onnx_llm.py`) where it can, else its Q4_0/Q4_1 blocks as int4, else float
    weights; on a GPU it takes the first of none, int8,
    int4 (for a quantized GGUF file those `gguf_modes` gives) whose weights plus one conversation's KV
    cache fit `free_bytes`. A pre-quantized (AWQ/GPTQ) checkpoint runs as int4 whatever was asked."""
    if config.quantization:
        return "int4", "asked for" if requested == "int4" else \
            f"the checkpoint holds {config.quantization.upper()} int4 weights: it runs as int4, not --quant {requested}"
    if requested == GGUF and not config.gguf_type:  # say, image chat's decoder beside a GGUF chat model
        mode, why = choose_quant("auto", config, dtype, device, free_bytes, context)
        return mode, f"--quant gguf is for GGUF files; this model runs as auto chose: {mode} ({why})"
    if requested == GGUF:
        return gguf_asked(config, dtype, device)
    if requested != "auto":
        return requested, "asked for"
    modes, gguf_why = gguf_modes(config)  # a quantized GGUF file: float weights would add nothing
    if device.type != "cuda" and MODES != modes and onnx_unavailable(config) is None:
        return GGUF, (f"auto on the CPU: a {config.gguf_type} file's blocks as stored, on ONNX Runtime (up to 1.9× "
                      f"the file's size in memory, measured)")
    if device.type != "cuda" and modes == ("int4",):  # the file's own 4-bit blocks, on torch's CPU kernels
        return "int4", f"auto on the CPU: {gguf_why}, on torch's CPU kernels (1.65× float32's speed, SmolLM2)"
    if device.type != "cuda" or free_bytes is None:
        return "none", "auto on the CPU: float32 (--quant int4 or int8 runs low-bit weights on torch's CPU kernels)"
    if GGUF in modes and (why := gguf_unavailable(device, dtype, set(config.gguf_tensor_types) & GGUF_KINDS)):
        modes = tuple(m for m in modes if m != GGUF)
        gguf_why = (f"a {config.gguf_type} file: as stored it cannot run here ({why}); int8 carries its weights "
                    f"within 0.1 % of their perplexity")
    kv = KVCache.row_bytes(config, context + 1, dtype)
    for mode in modes:
        need = weight_bytes(config, mode, dtype) + kv
        if need <= free_bytes:
            return mode, f"{need / 2**30:.1f} GiB of weights and one conversation's cache fit {free_bytes / 2**30:.1f} GiB" \
                + (f" ({gguf_why})" if gguf_why else "")
    return "int4", f"even int4 weights need more than the {free_bytes / 2**30:.1f} GiB there is: trying anyway"


def torch_decoder(model_dir: Path, model_id: str, mode: str, dtype: torch.dtype, device: torch.device,
                  engines: EngineOptions | None, verify: bool = False, vocab: int = 0) -> tuple[Decoder, str]:
    """The decoder with `mode` weights on `device`, and how its layers run. On a GPU the kernels its steps
    can launch (`verify`: speculative verify steps too; `vocab`: the tokenizer's, which the engine samples
    over) compile on all CPU cores, those that need no weights while the weights load (`plugins.precompile`)."""
    say = engines.report.tell if engines is not None else (lambda line: None)  # long work and fallbacks
    if mode == GGUF and device.type == "cpu":
        return onnx_gguf_decoder(model_dir, model_id, engines)
    if mode == GGUF:
        gguf_type = read_config(model_dir).gguf_type
        say(f"{model_id}: reading its {gguf_type} blocks onto the GPU as the file stores them")
        start = time.perf_counter()
        model = load_gguf_native(model_dir, dtype, device)
        held = sum(m.nbytes for m in model.modules() if isinstance(m, GGUFLinear))
        say(f"{model_id}: {gguf_type} blocks read in {time.perf_counter() - start:.1f} s "
            f"({held / 2**30:.2f} GiB of GPU memory)")
        return model, f"{gguf_type} blocks as stored (Triton GGUF kernels)"
    tuned = TunedConfigs(say)
    path = engines.cache.root / "kernels" / TunedConfigs.file_name(device) if engines and device.type == "cuda" else None
    if path is not None and path.is_file():  # this machine's own first (the release's for this GPU: `compile_ahead`)
        tuned.from_json(path.read_text())
    if device.type == "cuda":
        config = read_config(model_dir)
        with torch.device("meta"):
            shapes = empty_quantized(empty_decoder(config, dtype), mode) if mode != "none" else None
        compile_ahead(kernel_stand_ins(shapes, device) if shapes else [], tuned, verify, device,
                      model_calls(config, dtype, device, verify, vocab))
    if mode == "none":
        gguf_type = read_config(model_dir).gguf_type
        if gguf_type:  # read anew each launch (seconds for a 7B): say so, in the terminal and the UI
            say(f"{model_id}: unpacking its compressed weights (a {gguf_type} GGUF file) to run them in "
                f"{str(dtype).removeprefix('torch.')}, as each start does")
        model = load_decoder(model_dir, dtype=dtype, device=device)
        settle(say)
        return model, str(dtype).removeprefix("torch.")
    try:
        model = quantized_decoder(model_dir, mode, dtype, device, engines.cache if engines else None, say)
    except EngineBuildError as e:  # refused by its check, or its making failed: never used
        say(f"{model_id}: the {mode} weights cannot be used ({e}); loading the float weights instead")
        return load_decoder(model_dir, dtype=dtype, device=device), str(dtype).removeprefix("torch.")
    why = kernel_unavailable(model)
    if why is None:
        settle(say, CANDIDATES_WHAT)  # the tuning's first (the others compile in worker processes meanwhile)
        use_kernels(model, tuned)
        if path is not None and tuned.changed:
            atomic_write(path, tuned.to_json())
        if device.type == "cuda":
            compile_steps([m.kernel for m in model.modules() if isinstance(m, QuantLinear)], verify, say)
        settle(say)
        return model, f"{mode} weights (" + ("Triton low-bit kernels)" if device.type == "cuda" else
                                             "torch's CPU low-bit kernels, in bf16)")
    say(f"{model_id}: {why}")
    return model, f"{mode} weights (reference: dequantized per call)"


def warm_up(engine: TorchLLMEngine, model_id: str, say) -> None:
    """A first short reply before the tool counts as ready: Triton compiles the step's kernels (seconds
    on a first launch, read from its cache later) and the batch-1 decode graph is captured, so the
    user's first message does not pay for them in silence."""
    start = time.perf_counter()
    say(f"{model_id}: compiling the decode step's kernels and capturing its CUDA graph")
    # (speculating, the engine first compiles and captures each draft size's verify step and measures it)
    engine.submit(Prompt(tuple(range(1, 9))), SamplingParams(max_new_tokens=4, seed=0), set()).wait()
    say(f"{model_id}: decode step ready in {time.perf_counter() - start:.1f} s")


def load_draft(draft_id: str, target_dir: Path, device: str, dtype: torch.dtype, max_context: int, max_batch: int,
               engines: EngineOptions | None, quant: str, free_bytes: int | None) -> LanguageModel | None:
    """The draft model for speculative decoding, loaded (on a GPU in float or int4, whichever decodes
    faster there: `studio.draft_choice`; elsewhere as `quant`; its KV cache from `free_bytes`); None where
    it cannot load or does not share the target's tokenizer, and the start-up report says why: drafts
    then come from prompt lookup."""
    tell = engines.report.tell if engines is not None else (lambda line: None)
    try:
        folder = resolve(draft_id).path
        if not same_vocabulary(load_tokenizer(folder), load_tokenizer(target_dir)):
            tell(f"chat: the draft model {draft_id} does not share the chat model's tokenizer (its drafts would be "
                 f"other tokens); drafting by prompt lookup instead")
            return None

        def load(mode: str) -> LanguageModel:
            return load_language_model(folder, draft_id, "torch", device, dtype, max_context, max_batch,
                                       engines=engines, quant=mode, free_bytes=free_bytes, speculate="off")

        on_gpu = engines is not None and device.startswith("cuda")
        record = engines.cache.root / "kernels" / record_name("draft", draft_id, TunedConfigs.file_name(torch.device(device))) \
            if on_gpu else None
        draft = fastest_draft(load, draft_modes(device, quant), record, lambda line: tell(f"chat: {line}"))
    except (UserError, torch.cuda.OutOfMemoryError) as e:
        tell(f"chat: the draft model {draft_id} did not load ({e}); drafting by prompt lookup instead")
        return None
    tell(f"chat: drafts come from {draft_id} (speculative decoding)")
    return draft


def load_language_model(model_dir: Path, model_id: str, backend: str = "torch", device: str = "cpu",
                        dtype: torch.dtype = torch.float32, max_context: int = 8192, max_batch: int = 8,
                        kv_cache_bytes: int | None = None, engines: EngineOptions | None = None,
                        quant: str = "none", image_queries: int = 0, free_bytes: int | None = None,
                        speculate: str = "exact", draft: LanguageModel | None = None,
                        batch_invariant: bool | None = None) -> LanguageModel:
    """Tokenizer + engine for a checkpoint folder; `max_batch` conversations decode together; weights
    `quant`: none, int8, int4, or auto (what fits `free_bytes`, see `choose_quant`; on the CPU the model must fit
    the memory the machine has free: `check_memory`). Under `tensorrt`
    the engine is TensorRT-LLM's (with a prompt table for `image_queries` image embeddings per sequence),
    built once into the engine cache; a failed build falls back to torch. `speculate`: exact, fast or off
    (the torch engine's speculative decoding, `pipeline.llm.engine.speculation`); with a `draft` model (loaded,
    sharing the tokenizer: `load_draft`) drafts come from it instead of prompt lookup, and closing this model
    closes it. `batch_invariant`: `pipeline.llm.model.invariant` (None: where it can be; True: said where not)."""
    tokenizer = load_tokenizer(model_dir)
    config = read_config(model_dir)
    context = min(max_context, config.max_position_embeddings)
    target = torch.device(device)
    if free_bytes is None and target.type == "cuda":
        free_bytes = torch.cuda.mem_get_info(target)[0]
    quant, quant_why = choose_quant(quant, config, dtype, target, free_bytes, context)
    if target.type == "cpu":  # what the machine has free decides whether it loads (a laptop would swap)
        check_memory(model_id, config, quant, dtype, context, available_memory())
    if engines is not None and quant_why != "asked for":
        engines.report.say(f"{model_id}: --quant {quant} ({quant_why})")
    if backend == "tensorrt" and (config.quantization or batch_invariant):
        engines.report.say(f"{model_id}: runs on torch: " + ("batch-invariant replies need its kernels" if batch_invariant
                           else f"the TensorRT-LLM path builds from float checkpoints, not {config.quantization.upper()} ones"))
        backend = "torch"
    if backend == "tensorrt":
        try:
            def reference() -> TorchLLMEngine:  # the float torch engine on the CPU: no second copy on the GPU
                return load_language_model(model_dir, model_id, "torch", "cpu", dtype, max_context=256,
                                           max_batch=1).engine

            engine = load_trtllm_engine(model_dir, model_id, str(dtype).removeprefix("torch."), quant, max_context,
                                        max_batch, image_queries, engines, reference)
            return LanguageModel(tokenizer, engine, model_id, f"{model_id} · {engine.description}",
                                 checkpoint_defaults(model_dir))
        except Exception as e:  # noqa: BLE001 - any failure of a path that never ran here: fall back, say why
            engines.report.tell(f"{model_id}: the TensorRT-LLM engine failed ({failure(e)}); running on torch instead")
    model, weights = torch_decoder(model_dir, model_id, quant, dtype, target, engines, speculate != "off", tokenizer.vocab_size)
    if batch_invariant is not False:
        why = make_batch_invariant(model)
        weights += ", batch-invariant" if why is None else ""
        if engines is not None and (batch_invariant or why is None):
            engines.report.say(f"{model_id}: " + (f"--batch-invariant is off: {why}" if why else
                                                  "batch-invariant: a reply is the same whatever other chats run"))
    if kv_cache_bytes is None and free_bytes is not None:
        kv_cache_bytes = int((free_bytes - weight_bytes(config, quant, dtype)) * KV_SHARE_OF_FREE_MEMORY)
    rows, batch = cache_rows(config, context, dtype, max_batch, kv_cache_bytes)
    # ONNX Runtime's CPU decoder rounds its inputs to int8 per block: a verify step's rows and the decode steps they
    # stand for part at near-ties (so "exact" could not hold), and prompt lookup measured no faster there (SmolLM2)
    onnx_cpu = quant == GGUF and target.type == "cpu"
    measured_for = f"{model_id} {weights} {speculate} batch {batch} context {context}" + \
        (f" drafts {draft.model_id} {draft.engine.description}" if draft is not None else "")
    record = engines.cache.root / "kernels" / record_name(
        "verify", f"{Path(model_id).name}-{hashlib.sha256(measured_for.encode()).hexdigest()[:12]}",
        TunedConfigs.file_name(target)) if engines is not None and target.type == "cuda" else None
    speculation = None if speculate == "off" or onnx_cpu else \
        prompt_lookup(target.type, quant != "none", speculate == "exact", record)
    if speculation is not None and draft is not None:  # its cost is its own steps too: measured
        speculation = dataclasses.replace(speculation, drafter=DraftModel(draft.engine, f"the draft model "
                                                                                       f"{draft.model_id}"), measured=True,
                                          record=record)
    engine = TorchLLMEngine(model, context, tokenizer.vocab_size, max_batch=batch, rows=rows, speculation=speculation)
    if target.type == "cuda":
        warm_up(engine, model_id, engines.report.tell if engines is not None else (lambda line: None))
    params = weight_bytes(config, "none", torch.float32) / 4e6
    description = (f"{model_id} ({config.family}, {params:.1f} M params) · {engine.description} · "
                   f"{device} · {weights}")
    return LanguageModel(tokenizer, engine, model_id, description, checkpoint_defaults(model_dir))


def sam_engine(model: Sam, backend: str = "torch", weights: Path | None = None,
               engines: EngineOptions | None = None) -> SamEngine:
    """SAM's encode/decode engine: built engines (ONNX Runtime, TensorRT) for the weights read from
    `weights`, else captured CUDA graphs on a GPU and eager on the CPU; a failed build falls back to torch."""
    if backend != "torch":
        dtype = _dtype_name(model.image_encoder)
        try:
            encoder, decoder = build_engines("segment", sam_graphs(model.config), model, [weights], backend, dtype,
                                             engines)
            return SessionSamEngine(model.config, encoder, decoder, f"{backend} engine",
                                    RUNTIMES[backend].precision(dtype))
        except Exception as e:  # noqa: BLE001
            engines.report.tell(f"segment: the {backend} engine failed ({failure(e)}); running on torch instead")
    return torch_sam_engine(model)


def vision_encoder(model: MiniGPT4Vision, backend: str = "torch", weights: list[Path] | None = None,
                   engines: EngineOptions | None = None) -> VisionEncoder:
    """MiniGPT-4's image → query-embeddings engine, chosen like `sam_engine`."""
    if backend != "torch":
        weight = next(model.parameters())
        dtype = str(weight.dtype).removeprefix("torch.")
        try:
            (session,) = build_engines("image chat", (minigpt4_graph(model.config),), model, weights, backend, dtype,
                                       engines)
            return SessionVisionEncoder(model.config, session, f"{backend} engine", RUNTIMES[backend].precision(dtype),
                                        weight.device, weight.dtype)
        except Exception as e:  # noqa: BLE001
            engines.report.tell(f"image chat: the {backend} vision engine failed ({failure(e)}); running on torch "
                                f"instead")
    return TorchVisionEncoder(model)


def failure(e: Exception) -> str:
    """How an engine path's failure reads: our own errors as they are, anything else with its type
    (an API that changed under a new release, a driver error), since those paths cannot all run here."""
    return str(e) if isinstance(e, EngineBuildError) else f"{type(e).__name__}: {e}"


def _dtype_name(module: torch.nn.Module) -> str:
    return str(next(module.parameters()).dtype).removeprefix("torch.")
