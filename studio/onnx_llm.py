"""A GGUF file's decoder on the CPU as an ONNX Runtime engine (`engine_builder/gguf_onnx.py`), built on first
launch into the engine cache and mapped from it on later ones (`--quant gguf` there, `auto`'s first choice).

Why here: it is composition, the engine cache and the report around the graph builder and the decoder module
(`pipeline/llm/onnx_decoder.py`); `studio/backends.py` asks `unavailable` and calls `onnx_gguf_decoder`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from engine_builder import onnxruntime_backend
from engine_builder.build import EngineOptions
from engine_builder.cache import EngineCache, EngineKey
from engine_builder.fingerprint import fingerprint
from engine_builder.gguf_onnx import GRAPH, build, unsupported
from pipeline.llm.loading import gguf_as_stored
from pipeline.llm.onnx_decoder import OnnxDecoder, TableEmbedding, threads
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.weights.gguf_file import read_gguf
from pipeline.llm.weights.gguf_nbits import KINDS

FLOATS = {"F32", "F16", "BF16"}  # matrices the graph multiplies in float32
COMPONENT = "llm_decoder_gguf"
GRAPH_FORMAT = 2  # bump when the graph `gguf_onnx.build` writes changes: cached engines are rebuilt


def unavailable(config) -> str | None:
    """None when a GGUF file of `config` runs on this engine, else why not."""
    if (why := onnxruntime_backend.unavailable()) is not None:
        return why
    if (why := unsupported(config)) is not None:
        return why
    if missing := set(config.gguf_tensor_types) - KINDS - FLOATS:
        return f"its {', '.join(sorted(missing))} blocks have no ONNX Runtime form here"
    return None


def _key(gguf: Path, cache: EngineCache) -> EngineKey:
    return EngineKey(COMPONENT, str(gguf.resolve()), fingerprint([gguf], cache.root), "gguf", {}, "onnxruntime",
                     f"{onnxruntime_backend.version()} graph {GRAPH_FORMAT}", onnxruntime_backend.device_name())


def onnx_gguf_decoder(model_dir: Path, model_id: str, engines: EngineOptions | None):
    """The `OnnxDecoder` of a GGUF folder and how it runs: the engine from `engines`' cache (built now when
    missing or stale, with progress), or, without `engines` (benchmarks, tests), built into a temporary
    folder that lives as long as the decoder."""
    import onnxruntime as ort  # here, not at the top: the app starts without waiting for it

    say = engines.report.tell if engines is not None else (lambda line: None)
    config = read_config(model_dir)
    gguf = Path(config.gguf_file)
    held = None if engines is not None else tempfile.TemporaryDirectory(prefix="gguf-onnx.")
    cache = engines.cache if held is None else EngineCache(Path(held.name))

    def make(folder: Path, reason: str) -> None:
        say(f"{model_id}: building its ONNX Runtime engine from the file's {config.gguf_type} blocks ({reason})")
        start = time.perf_counter()
        _, sd, embed_kind, head_kind = gguf_as_stored(model_dir, torch.float32, KINDS)
        head = (sd["embed.weight"], embed_kind) if config.tie_word_embeddings else (sd.pop("lm_head.weight"), head_kind)
        with tqdm(total=config.num_layers, desc=f"{model_id}: ONNX engine", unit="layer", file=sys.stderr) as bar:
            build(folder, config, sd, head, lambda done, total: bar.update(done - bar.n))
        say(f"{model_id}: ONNX Runtime engine built in {time.perf_counter() - start:.1f} s")

    def load(folder: Path) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads()
        return ort.InferenceSession(str(folder / GRAPH), options, providers=["CPUExecutionProvider"])

    session, cached = cache.get(_key(gguf, cache), make, load)
    if not cached.built:
        say(f"{model_id}: ONNX Runtime engine {cached.outcome()}")
    tensors = read_gguf(gguf).tensors
    table, norm = tensors["token_embd.weight"], tensors["output_norm.weight"]
    model = OnnxDecoder(config, session, TableEmbedding(table.data.reshape(table.shape[0], -1), table.kind,
                                                        config.hidden_size),
                        torch.from_numpy(norm.data.astype("float32").copy()))
    model.engine_folder = held  # a temporary build's folder, removed when the decoder is (None: the cache's)
    return model, f"{config.gguf_type} blocks as stored (ONNX Runtime, {threads()} threads)"

