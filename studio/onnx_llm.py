"""A decoder on the CPU as an ONNX Runtime engine (`engine_builder/gguf_onnx.py`), built on first launch into the
engine cache and mapped from it on later ones: a GGUF file's, its matrices as stored (`--quant gguf` there,
`auto`'s first choice), or a float checkpoint's, its matrices rounded to 8-bit blocks (image chat's decoder).

Why here: it is composition, the engine cache and the report around the graph builder and the decoder module
(`pipeline/llm/model/onnx_decoder.py`); `studio/backends.py` asks `unavailable` and calls `onnx_gguf_decoder`,
`studio/vlm.py` asks `float_unavailable` and calls `onnx_float_decoder`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from engine_builder import onnxruntime_backend
from engine_builder.build import EngineOptions
from engine_builder.cache import EngineCache, EngineKey
from engine_builder.fingerprint import fingerprint
from engine_builder.gguf_onnx import GRAPH, build, unsupported
from pipeline.llm.model.loading import gguf_as_stored
from pipeline.llm.model.onnx_decoder import OnnxDecoder, TableEmbedding, threads
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.weights.gguf_file import read_gguf, split_parts
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.weights.gguf_nbits import KINDS, to_blocks
from pipeline.llm.weights.quant import QUANTIZED

if TYPE_CHECKING:
    import onnxruntime as ort

Held = tempfile.TemporaryDirectory | None  # a temporary engine's folder, kept while its session lives
FLOATS = {"F32", "F16", "BF16"}  # matrices the graph multiplies in float32
COMPONENT = "llm_decoder_gguf"
FLOAT_COMPONENT = "llm_decoder_float_blocks"
# A float checkpoint's matrices on this engine: 8-bit blocks of 32 (int8 perplexity +0.07 % on SmolLM2; 4-bit
# blocks rounded from floats would cost far more on small models)
FLOAT_BLOCKS = "Q8_0"
GRAPH_FORMAT = 3  # bump when the graph `gguf_onnx.build` writes changes: cached engines are rebuilt


def unavailable(config) -> str | None:
    """None when a GGUF file of `config` runs on this engine, else why not."""
    if (why := onnxruntime_backend.unavailable()) is not None:
        return why
    if (why := unsupported(config)) is not None:
        return why
    if missing := set(config.gguf_tensor_types) - KINDS - FLOATS:
        return f"its {', '.join(sorted(missing))} blocks have no ONNX Runtime form here"
    return None


def float_unavailable(config) -> str | None:
    """None when a float checkpoint's decoder of `config` runs on this engine as `FLOAT_BLOCKS`, else why not."""
    if (why := unavailable(config)) is not None:
        return why
    if odd := sorted({w for w in (config.hidden_size, config.q_size, config.intermediate_size) if w % 32}):
        return f"its widths {odd} are not whole blocks of 32"
    return None


def _session(component: str, files: list[Path], weights: str, build_into: Callable[[Path], None], what: str,
             model_id: str, engines: EngineOptions | None) -> tuple[ort.InferenceSession, Held]:
    """The engine of the weight `files` (their `weights` form) from `engines`' cache (`build_into` a folder now
    when missing or stale, with progress), or, without `engines` (benchmarks, tests), built into a temporary
    folder returned with it, which must live as long as the session."""
    import onnxruntime as ort  # here, not at the top: the app starts without waiting for it

    say = engines.report.tell if engines is not None else (lambda line: None)
    held = None if engines is not None else tempfile.TemporaryDirectory(prefix="onnx-llm.")
    cache = engines.cache if held is None else EngineCache(Path(held.name))

    def make(folder: Path, reason: str) -> None:
        say(f"{model_id}: building its ONNX Runtime engine from {what} ({reason})")
        start = time.perf_counter()
        build_into(folder)
        say(f"{model_id}: ONNX Runtime engine built in {time.perf_counter() - start:.1f} s")

    def load(folder: Path) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads()
        return ort.InferenceSession(str(folder / GRAPH), options, providers=["CPUExecutionProvider"])

    key = EngineKey(component, str(files[0].resolve()), fingerprint(files, cache.root), weights, {}, "onnxruntime",
                    f"{onnxruntime_backend.version()} graph {GRAPH_FORMAT}", onnxruntime_backend.device_name())
    session, cached = cache.get(key, make, load)
    if not cached.built:
        say(f"{model_id}: ONNX Runtime engine {cached.outcome()}")
    return session, held


def _build_bar(model_id: str, config) -> tqdm:
    return tqdm(total=config.num_layers, desc=f"{model_id}: ONNX engine", unit="layer", file=sys.stderr)


def onnx_gguf_decoder(model_dir: Path, model_id: str, engines: EngineOptions | None) -> tuple[OnnxDecoder, str]:
    """The `OnnxDecoder` of a GGUF folder (its matrices as the file stores them) and how it runs."""
    config = read_config(model_dir)
    gguf = Path(config.gguf_file)

    def build_into(folder: Path) -> None:
        _, sd, embed_kind, head_kind = gguf_as_stored(model_dir, torch.float32, KINDS)
        head = (sd["embed.weight"], embed_kind) if config.tie_word_embeddings else (sd.pop("lm_head.weight"), head_kind)
        with _build_bar(model_id, config) as bar:
            build(folder, config, sd, head, lambda done, total: bar.update(done - bar.n))

    session, held = _session(COMPONENT, split_parts(gguf), "gguf", build_into,
                             f"the file's {config.gguf_type} blocks", model_id, engines)
    tensors = read_gguf(gguf).tensors
    table, norm = tensors["token_embd.weight"], tensors["output_norm.weight"]
    model = OnnxDecoder(config, session, TableEmbedding(table.data.reshape(table.shape[0], -1), table.kind,
                                                        config.hidden_size),
                        torch.from_numpy(norm.data.astype("float32").copy()))
    model.engine_folder = held  # a temporary build's folder, removed when the decoder is (None: the cache's)
    return model, f"{config.gguf_type} blocks as stored (ONNX Runtime, {threads()} threads)"


def onnx_float_decoder(decoder: Decoder, weights: list[Path], model_id: str,
                       engines: EngineOptions | None) -> tuple[OnnxDecoder, str]:
    """The `OnnxDecoder` of a float checkpoint's `decoder` (read from the files `weights`), its matrices rounded
    to `FLOAT_BLOCKS` as llama.cpp rounds them, and how it runs. Its embedding stays the float table; the
    torch decoder's layers are not kept."""
    config = decoder.config

    def build_into(folder: Path) -> None:
        sd = {name: value.detach().float() for name, value in decoder.state_dict().items()}
        for i in range(config.num_layers):
            for path in QUANTIZED:
                weight = sd.pop(f"layers.{i}.{path}.weight")
                sd[f"layers.{i}.{path}.matrices"] = [(to_blocks(weight, FLOAT_BLOCKS), FLOAT_BLOCKS)]
        head = (to_blocks(sd["lm_head.weight"], FLOAT_BLOCKS), FLOAT_BLOCKS)
        with _build_bar(model_id, config) as bar:
            build(folder, config, sd, head, lambda done, total: bar.update(done - bar.n))

    session, held = _session(FLOAT_COMPONENT, weights, FLOAT_BLOCKS, build_into,
                             f"its float weights rounded to {FLOAT_BLOCKS} blocks", model_id, engines)
    model = OnnxDecoder(config, session, decoder.embed, decoder.norm.weight.detach())
    model.engine_folder = held
    return model, f"int8 weights ({FLOAT_BLOCKS} blocks on ONNX Runtime, {threads()} threads)"
