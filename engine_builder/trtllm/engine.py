"""TensorRT-LLM's C++ executor behind the `LLMEngine` seam, and its build through the engine cache.

The executor does what `TorchLLMEngine` does (in-flight batching, a paged KV cache with block reuse
for follow-up turns, per-request sampling and seeds), so this module only translates: a `Prompt`
becomes token ids plus a prompt-embedding table for image slots (`prompt_table`), `SamplingParams`
a `SamplingConfig`, and the executor's streamed responses the `TokenStream` the pipelines read.
One thread collects responses for every request and cancels the ones whose stream was cancelled.

Written against TensorRT-LLM 1.2's sources (`tensorrt_llm.bindings.executor`: `Executor`,
`Request(input_token_ids, max_tokens, *, streaming, sampling_config, stop_words, prompt_tuning_config)`,
`PromptTuningConfig(embedding_table, input_token_extra_ids)`, unchanged since 0.21); it cannot be
installed here, so this module has not run. What it is built on is tested: the checkpoint, the build settings
and the prompt-table layout (tests/test_trtllm_prep.py), and the stream bookkeeping (`_Request`).
"""

from __future__ import annotations

import dataclasses
import datetime
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine_builder import trtllm
from engine_builder.build import EngineOptions
from engine_builder.cache import EngineBuildError, EngineCache, EngineKey, Verdict
from engine_builder.engine_check import check_llm
from engine_builder.fingerprint import fingerprint
from engine_builder.trtllm.build import build_engine, build_settings
from engine_builder.trtllm.checkpoint import DTYPES, engine_context, write_trtllm_checkpoint
from engine_builder.trtllm.prompt_table import prompt_table_input
from pipeline.errors import UserError
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.engine.torch_engine import TorchLLMEngine
from pipeline.llm.engine.seam import FinishReason, TokenStream
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.prompt import Prompt

FINISH_REASONS = {"END_ID": FinishReason.STOP, "STOP_WORDS": FinishReason.STOP, "LENGTH": FinishReason.LENGTH,
                  "CANCELLED": FinishReason.CANCELLED, "TIMED_OUT": FinishReason.CANCELLED}


@dataclasses.dataclass
class _Request:
    """One request's stream and bookkeeping: tokens in, stop ids and statistics handled as the torch
    engine handles them (a stop id ends the reply and is not delivered)."""

    stream: TokenStream
    stop_ids: set[int]
    submitted: float
    first_token_at: float = 0.0
    cancel_sent: bool = False

    def take(self, tokens: list[int], final_reason: FinishReason | None) -> bool:
        """Deliver `tokens`; True once the request is over (a stop id, or the executor's final response)."""
        stats, now = self.stream.stats, time.perf_counter()
        for token in tokens:
            if not self.first_token_at:
                self.first_token_at = now
                stats.time_to_first_token_s = now - self.submitted
            stats.decode_s = now - self.first_token_at
            if token in self.stop_ids:
                self.stream.end(FinishReason.STOP)
                return True
            stats.new_tokens += 1
            self.stream.deliver(token)
        if final_reason is not None:
            self.stream.end(final_reason)
            return True
        return False


class TrtLlmEngine:
    """An engine folder (`Engine.save` output) served by TensorRT-LLM's executor."""

    @staticmethod
    def require() -> None:
        """Raise `EngineBuildError` saying why TensorRT-LLM cannot run here (not installed, or another
        release line than these modules are written for): what the app prints before it runs on torch."""
        if (why := trtllm.unavailable()) is not None:
            raise EngineBuildError(why)

    def __init__(self, engine_dir: Path, config: DecoderConfig, context: int, dtype: str, max_batch: int,
                 description: str):
        self.require()
        from tensorrt_llm.bindings import executor as tx

        self._tx = tx
        self.config, self.context, self.hidden_size = config, context, config.hidden_size
        self.dtype, self.max_batch = DTYPES[dtype], max_batch
        self.description = description
        kv = tx.KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction=0.4)
        self.executor = tx.Executor(Path(engine_dir), tx.ModelType.DECODER_ONLY,
                                    tx.ExecutorConfig(max_beam_width=1, kv_cache_config=kv))
        self._requests: dict[int, _Request] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._collect, name="trtllm-responses", daemon=True)
        self._thread.start()

    def submit(self, prompt: Prompt, params: SamplingParams, stop_ids: set[int], session: str | None = None,
               cancel: threading.Event | None = None, keep_logits: bool = False, grammar: object = None) -> TokenStream:
        """`session` is not needed: the executor's KV-cache block reuse finds a conversation's prefix itself.
        Structured outputs and log-probabilities are refused here (not yet wired to the executor's own)."""
        if keep_logits:
            raise UserError("the TensorRT-LLM engine does not return logits; use --backend torch")
        if grammar is not None or params.logprobs is not None or params.logit_bias:
            raise UserError("structured outputs, required tool calls, logprobs and logit_bias run on the torch "
                            "engine: start the app with --backend torch for them",
                            "response_format" if grammar else "logprobs" if params.logprobs is not None
                            else "logit_bias")
        if not 0 < len(prompt) < self.context:
            raise UserError(f"a prompt of {len(prompt)} tokens does not fit the context of {self.context}")
        tx = self._tx
        table = prompt_table_input(prompt, self.config, self.dtype)
        greedy = params.temperature == 0
        sampling = tx.SamplingConfig(beam_width=1, top_k=1 if greedy else (params.top_k or None),
                                     top_p=None if greedy else params.top_p,
                                     temperature=None if greedy else params.temperature,
                                     repetition_penalty=params.repetition_penalty, seed=params.seed,
                                     presence_penalty=params.presence_penalty or None,
                                     frequency_penalty=params.frequency_penalty or None)
        tuning = tx.PromptTuningConfig(table.table, table.extra_ids) if table.table is not None else None
        request = tx.Request(table.ids, min(params.max_new_tokens, self.context - len(prompt)), streaming=True,
                             sampling_config=sampling, stop_words=[[i] for i in sorted(stop_ids)],
                             prompt_tuning_config=tuning)
        stream = TokenStream(cancel, keep_logits=False)
        stream.stats.prompt_tokens = len(prompt)
        with self._lock:
            if self._closed:
                raise UserError("the language model was unloaded; reload the page")
            self._requests[self.executor.enqueue_request(request)] = _Request(stream, set(stop_ids),
                                                                              time.perf_counter())
        return stream

    def _collect(self) -> None:
        wait = datetime.timedelta(milliseconds=100)  # responses wake it at once; this bounds how late a Stop is sent
        while not self._closed:
            for response in self.executor.await_responses(timeout=wait):
                with self._lock:
                    request = self._requests.get(response.request_id)
                if request is None:
                    continue
                if response.has_error():
                    request.stream.deliver(RuntimeError(f"TensorRT-LLM: {response.error_msg}"))
                    done = request.take([], FinishReason.ERROR)
                else:
                    result = response.result
                    reason = None
                    if result.is_final:
                        name = result.finish_reasons[0].name if result.finish_reasons else "LENGTH"
                        reason = request.stream.reason if request.stream.cancelled else \
                            FINISH_REASONS.get(name, FinishReason.STOP)
                    done = request.take(list(result.output_token_ids[0]), reason)
                if done:
                    with self._lock:
                        self._requests.pop(response.request_id, None)
                    if not response.has_error() and not response.result.is_final:
                        self.executor.cancel_request(response.request_id)  # ended by a stop id
            with self._lock:
                cancelled = [(i, r) for i, r in self._requests.items() if r.stream.cancelled and not r.cancel_sent]
            for request_id, request in cancelled:
                request.cancel_sent = True
                self.executor.cancel_request(request_id)

    def status(self) -> dict[str, int]:
        with self._lock:
            return {"running": len(self._requests), "queued": 0, "max_batch": self.max_batch}

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=30)
        self.executor.shutdown()


def trtllm_key(model_dir: Path, dtype: str, quant: str, max_context: int, max_batch: int, image_queries: int,
               cache: EngineCache) -> tuple[EngineKey, int, dict]:
    """The engine's cache key (for a launch and for `--check`), its context and its build settings."""
    import tensorrt_llm

    context = engine_context(read_config(model_dir), max_context)
    settings = build_settings(max_batch, context, image_queries)
    major, minor = torch.cuda.get_device_capability()
    key = EngineKey("llm", str(Path(model_dir).resolve()), fingerprint([model_dir], cache.root), f"{dtype}+{quant}",
                    settings, "tensorrt-llm", tensorrt_llm.__version__,
                    f"{torch.cuda.get_device_name()} (sm_{major}{minor})")
    return key, context, settings


def load_trtllm_engine(model_dir: Path, model_id: str, dtype: str, quant: str, max_context: int, max_batch: int,
                       image_queries: int, options: EngineOptions,
                       reference: Callable[[], TorchLLMEngine]) -> TrtLlmEngine:
    """The TensorRT-LLM engine for a checkpoint folder, built into the engine cache on first use and
    used only once it passes `check_llm` against `reference()` (the float torch engine on the same weights)."""
    TrtLlmEngine.require()
    import tensorrt_llm

    config = read_config(model_dir)
    key, context, settings = trtllm_key(model_dir, dtype, quant, max_context, max_batch, image_queries, options.cache)
    label = f"{model_id}: TensorRT-LLM engine ({dtype}, weights {quant})"

    def build(folder: Path, reason: str) -> None:
        options.report.tell(f"{label}: building ({reason}); this takes a few minutes")
        with tempfile.TemporaryDirectory(prefix=key.slot() + ".checkpoint.", dir=options.cache.root) as tmp:
            write_trtllm_checkpoint(Path(model_dir), Path(tmp), dtype, quant, context)
            build_engine(Path(tmp), folder, settings)

    def load(folder: Path) -> TrtLlmEngine:
        return TrtLlmEngine(folder, config, context, dtype, max_batch,
                            f"TensorRT-LLM {tensorrt_llm.__version__} · batch up to {max_batch} · {context} tokens · "
                            f"{dtype}, weights {quant}")

    def verify(engine: TrtLlmEngine) -> Verdict:
        options.report.tell(f"{label}: checking it against the torch engine (float weights)")
        torch_engine = reference()
        try:
            scale = float(torch_engine.model.embed.weight.float().std())  # probe "images" at the embeddings' scale
            return check_llm(engine, torch_engine, quant, image_queries, scale)
        finally:
            torch_engine.close()

    engine, cached = options.cache.get(key, build, load, verify)
    (options.report.tell if cached.built else options.report.say)(f"{label}: {cached.outcome()}")
    return engine
