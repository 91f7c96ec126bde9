"""The torch LLM engine: one thread that serves many chats at once behind the `LLMEngine` seam
(`pipeline.llm.engine.seam`).

`TorchLLMEngine` works like a serving engine (vLLM v1, TensorRT-LLM's executor): one engine thread runs
continuous batching over four parts, each testable alone: the `Scheduler` (which requests wait, read their
prompts or run, in which cache rows, and each step's token budget), `CacheRows` (the static KV cache and
what each row holds, found by content through block hashes), the `ModelRunner` (the decoder, its rotary
tables and CUDA graphs) and the `Sampler` (every draw, with biases, grammar masks, penalties and
log-probabilities). This module keeps the loop and each request's life.

There is one kind of step (`_step`): under one token budget, every running request feeds its last token
(and, speculating, the tokens drafted after it: `speculation.py`, asked of the drafter once for all rows),
and requests reading their prompts feed chunks of them, shared fairly; one forward runs it all and one
draw keeps each row's tokens. A step without drafts is pipelined: its inputs are the previous step's
tokens, made on the GPU, and the host reads those tokens while the GPU runs this step. A prompt's last
chunk draws its first token, and the request joins the running ones. Finished or cancelled requests
leave at once. A row keeps its tokens after a reply, and a new request runs in the idle row holding the
longest prefix of it, so a conversation's next turn prefills only what is new whoever sends it (the UI,
an API client resending the whole conversation, the terminal chat). Idle rows are reclaimed least
recently used.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from pipeline.errors import UserError
from pipeline.llm.engine.cache_rows import CacheRows
from pipeline.llm.engine.seam import FinishReason, TokenStream
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.text.grammar import Grammar
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.engine.model_runner import ChunkRead, ModelRunner, RowsFeed
from pipeline.llm.engine.outputs import Launched, Outputs
from pipeline.llm.engine.sampler import Sampler
from pipeline.llm.engine.params import InvalidSampling, SamplingParams
from pipeline.llm.engine.sampling import Draws
from pipeline.llm.engine.scheduler import Request, Scheduler
from pipeline.llm.engine.proposer import Proposer
from pipeline.llm.engine.speculation import DRAFT_SIZES, DraftState, Speculation
from plugins.cuda_streams import launching

LONE = 8  # a prompt read with no request running goes in chunks of LONE × prefill_chunk (1,024 by default)


class TorchLLMEngine:
    """Continuous batching over a static KV cache; see the module docstring.

    `max_batch` (a power of two) requests decode together; `rows` cache rows (≥ max_batch) keep
    idle sessions' turns for reuse. Decode steps replay a CUDA graph per (batch bucket, context
    bucket) on a GPU and run eagerly on the CPU. `prefill_chunk`: each step's token budget while
    requests run, shared by their decodes (and drafts) and the prompt chunks of joining ones (128: the
    running chats' largest gap while an 8th reads 4,000 tokens is 1.65× their step at 7B on an H200, 2.33×
    with 256, whose extra GEMM rows alone make 1.8×; `bench/chunked_prefill.py`); with none
    running, prompts are read in chunks LONE times as long, so a prompt that joins then waits for one such
    chunk, not for a long prompt's whole read (None or 0: a joining prompt is read whole at once, stalling
    the running requests meanwhile; for comparison).
    """

    def __init__(self, model: Decoder, context: int, vocab_size: int, max_batch: int = 8, rows: int | None = None,
                 use_cuda_graphs: bool | None = None, prefill_chunk: int | None = 128,
                 speculation: Speculation | None = None):
        if max_batch < 1 or max_batch & (max_batch - 1):
            raise ValueError(f"max_batch must be a power of two, got {max_batch}")
        c = model.config
        if context > c.max_position_embeddings:
            raise UserError(f"context {context} exceeds the model's {c.max_position_embeddings} positions")
        self.context, self.vocab_size, self.max_batch = context, vocab_size, max_batch
        self.device, self.hidden_size = model.norm.weight.device, c.hidden_size
        rows = max(rows or 2 * max_batch, max_batch)
        self.runner = ModelRunner(model, context, vocab_size, max_batch, use_cuda_graphs,
                                  exact_verify=speculation is None or speculation.exact)
        self.rows = CacheRows(c, rows, self.runner.positions, vocab_size, model.norm.weight.dtype, self.device)
        self.scheduler = Scheduler(max_batch, self.rows, prefill_chunk, prefill_chunk and LONE * prefill_chunk)
        self.sampler = Sampler(self.rows, vocab_size, max_batch, self.device)
        self.outputs = Outputs(self.scheduler, self.rows, context, self.runner.to_host)
        self._pending: Launched | None = None  # the decode step in flight, its tokens not yet read
        self._starting: list[Launched] = []  # first tokens drawn after prompts' last chunks, read a step later
        self.speculation = speculation
        self.proposer = Proposer(speculation, context) if speculation is not None else None
        self.steps = self.verify_steps = 0  # decode steps run, verify steps among them (for tests and benchmarks)
        self.prefilled_tokens = self.reused_tokens = 0  # prompt positions computed, and found in the cache
        self.drafted_tokens = self.accepted_tokens = 0  # speculative decoding's drafts checked, and kept
        self.description = (f"torch{' (CUDA graphs)' if self.use_cuda_graphs else ''} · batch up to {max_batch} · "
                            f"{rows} cache rows of {context} tokens"
                            f"{f' · prefill in chunks of {prefill_chunk}' if prefill_chunk else ''}"
                            f"{f' · {speculation.description}' if speculation else ''}")
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    @property
    def model(self) -> Decoder:
        return self.runner.model

    @property
    def use_cuda_graphs(self) -> bool:
        return self.runner.use_cuda_graphs

    # ---- the seam ----------------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams, stop_ids: set[int], session: str | None = None,
               cancel: threading.Event | None = None, keep_logits: bool = False,
               grammar: Grammar | None = None) -> TokenStream:
        """Queue a request; its tokens arrive on the returned stream (with their log-probabilities in
        `stream.logprobs` where `params.logprobs` asks; only tokens `grammar` allows, given one).
        Raises `UserError` at once for a prompt that cannot fit."""
        if not 0 < len(prompt) < self.context:
            raise UserError(f"a prompt of {len(prompt)} tokens does not fit the context of {self.context}")
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:
            raise InvalidSampling("logit_bias", f"logit_bias names token {params.logit_bias[-1][0]}, but this "
                                                f"model's token ids run from 0 to {self.vocab_size - 1}")
        stream = TokenStream(cancel, keep_logits, params.logprobs is not None)
        stream.stats.prompt_tokens = len(prompt)
        draft = DraftState(self.speculation.drafter.index()) if self.speculation is not None else None
        self.scheduler.add(Request(prompt, params, set(stop_ids), session, stream, Draws(params.seed),
                                   time.perf_counter(), grammar, draft=draft))
        return stream

    def status(self) -> dict[str, int]:
        """What the engine is doing now (for the UI and tests): requests running and queued, and so on."""
        return {**self.scheduler.status(), "decode_steps": self.steps, "prefilled_tokens": self.prefilled_tokens,
                "reused_tokens": self.reused_tokens, "verify_steps": self.verify_steps,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens}

    def close(self) -> None:
        """Stop the engine thread (queued and running requests end "cancelled") and let go of the model,
        its cache and its graphs, so an unloaded tool's memory is freed."""
        self.scheduler.close()
        if self.speculation is not None:
            self.speculation.drafter.close()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.runner.close()
            self.rows.kv = self.rows.seen = self.rows.counts = self._pending = None

    # ---- the engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        self.runner.enter_thread()
        scheduler = self.scheduler
        with torch.inference_mode():
            if self.speculation is not None and self.device.type == "cuda":
                try:
                    self._measure()
                except Exception as e:  # noqa: BLE001 - the prior costs serve; the steps capture at first use
                    warnings.warn(f"measuring the verify steps failed ({type(e).__name__}: {e}); speculation "
                                  f"takes the prior costs", stacklevel=1)
            while (joining := scheduler.next_joining()) is not None:
                with launching():  # GPU work: no other thread's graph capture meanwhile (`plugins.cuda_streams`)
                    for request in joining:
                        self._guarded([request], self._admit, request)
                    if any(r.stream.cancelled for r in scheduler.running):
                        self._guarded(list(scheduler.running), self._drain)  # settle the step in flight first
                for r in [r for r in scheduler.running + scheduler.prefilling if r.stream.cancelled]:
                    self.outputs.finish(r, r.stream.reason)
                self._guarded(scheduler.running + scheduler.prefilling, self._step)
            self._pending, self._starting = None, []
            for request in scheduler.drop_all():
                self.outputs.finish(request, FinishReason.CANCELLED)

    def _measure(self) -> None:
        """Compile and capture every draft size's verify step of one row and of a full batch before a reply
        needs it, and where the speculation asks for it take their costs measured on this GPU
        (`ModelRunner.verify_cost`)."""
        with launching():
            measured = {rows: self.runner.verify_cost(self.rows.kv, rows) for rows in sorted({1, self.max_batch})}
        if self.speculation.measured:
            self.proposer.costs = measured

    def _guarded(self, requests: list[Request], fn: Callable, *args) -> None:
        """Run `fn`; if it fails, the requests involved end with the error and the engine carries on
        (the decode step in flight is dropped where they ran in it: its state is unknown)."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to the callers, who raise it
            self._fail(requests, e)

    def _fail(self, requests: list[Request], e: Exception) -> None:
        """End `requests` with the error `e` (the step in flight is dropped where they ran in it)."""
        if isinstance(e, torch.OutOfMemoryError):
            e = UserError("the GPU ran out of memory for this reply: shorten the conversation or lower max new tokens")
        if self._pending is not None and set(requests) & set(self._pending.requests):
            self._pending = None
        for request in requests:
            request.stream.deliver(e)
            self.outputs.finish(request, FinishReason.ERROR)

    def _admit(self, request: Request) -> None:
        """Give a new request a row, the one holding the longest cached prefix of its prompt: its
        prompt is read from there, chunk by chunk."""
        if request.stream.cancelled:
            self.outputs.finish(request, request.stream.reason)
            return
        sig = request.prompt.signature()
        request.table = self.runner.rope.table_for(len(sig))
        reused = min(self.scheduler.place(request, sig), len(sig) - 1)  # the last token must run for its logits
        self.rows.hold(request.row, sig[:reused], request.table, request.session)
        request.position = self.rows[request.row].written = reused
        request.stream.stats.cached_tokens = reused
        self.reused_tokens += reused

    def _step(self) -> None:
        """One engine step: the drafts (where speculating), the prompt chunks the budget leaves room for,
        one forward over all of it, the draws; then the first tokens of the prompts the step before
        finished are read (while the GPU works on this one; first, where nothing decodes), and their
        requests join the running ones. The host stays at most one step ahead of the GPU."""
        with launching():  # (the drafts outside: a draft model's engine may be waiting to capture a graph)
            if self._pending is not None and self._pending.requests != self.scheduler.running:
                self._drain()  # the batch changed: this step's inputs come from the host
            starting, self._starting = self._starting, []
            if not self.scheduler.running:  # no GPU work to overlap: read them now, and they decode in this step
                for step in starting:
                    self._guarded(step.requests, self.outputs.read, step, True)
                starting = []
        drafts = self._propose() if self.speculation is not None and self.scheduler.running else None
        active = list(self.scheduler.running)
        chunks = self.scheduler.chunks(sum(map(len, drafts)) if drafts else 0)
        with launching():
            if active or chunks:
                try:
                    self._launch(active, drafts, chunks)
                except Exception as e:  # noqa: BLE001 - a step that read prompts: theirs end, the running take it again
                    if not chunks:
                        raise
                    self._fail([r for r, _ in chunks], e)
                    self._drain()  # the rows were not advanced: their next step starts from the host
                self.runner.one_step_ahead()
            for step in starting:
                self._guarded(step.requests, self.outputs.read, step, True)

    def _offset(self, request: Request, position: int) -> int:
        """The rotary offset of `request`'s tokens from `position` on: its table's, moved by its prompt's
        M-RoPE shift there (0 but for Qwen2.5-VL's pictures)."""
        return self.runner.rope.offset(request.table, request.prompt.shift(position))

    def _launch(self, active: list[Request], drafts: list[list[int]] | None,
                chunks: list[tuple[Request, int]]) -> None:
        """Run one step: rows 0..n-1 feed their last token (after the step in flight, chained on the GPU) or,
        where some drafted, their last token and drafts (padded to a draft size); the chunks are read beside
        them. A prompt's last chunk draws its first token, read at the next step."""
        feed = None
        if active and (drafts is not None or self._pending is None):
            size = next(k for k in (0, *DRAFT_SIZES) if k >= max(map(len, drafts or [[]]))) + 1
            fed = [[r.last_token, *d, *[r.last_token] * (size - 1 - len(d))] for r, d in zip(active, drafts or [[]] * len(active))]
            feed = RowsFeed(len(active), fed, [r.position for r in active], [self._offset(r, r.position) for r in active],
                            kv_need=max(r.position for r in active) + size)
        elif active:
            feed = RowsFeed(len(active), chained=self._pending.drawn, kv_need=max(r.position for r in active) + 1)
        reads = [ChunkRead(r.prompt, r.row, r.position, end, self._offset(r, r.position), end == len(r.sig))
                 for r, end in chunks]
        logits, firsts = self.runner.step(self.rows.kv, feed, reads, graphed=bool(active))
        self.steps += bool(active)
        for r, end in chunks:
            self.prefilled_tokens += end - r.position
            r.position = self.rows[r.row].written = end
        for r, first in zip([r for r, end in chunks if end == len(r.sig)], firsts):
            self.rows.hold(r.row, r.sig, r.table, r.session)
            self.sampler.start(r)
            drawn, _, logprobs = self.sampler.draw([r], first[None, None], r.row)
            r.draws.skip(1)
            self._starting.append(self.outputs.launched([r], drawn[:, 0], first[None].clone() if r.stream.logits is not None
                                                 else None, logprobs[:, 0] if logprobs is not None else None))
        if drafts is not None:
            self._settle(active, drafts, logits)
        elif active:
            for r in active:
                r.position += 1
                self.rows[r.row].written = r.position
            if self._pending is not None and any(r.grammar is not None for r in active):
                self.outputs.consume(self._pending)  # this step's masks need the last tokens (the GPU runs the forward meanwhile)
            kept = logits[:, 0].clone() if any(r.stream.logits is not None for r in active) else None  # graphs reuse theirs
            drawn, _, logprobs = self.sampler.draw(active, logits, 0)
            for r in active:
                r.draws.skip(1)
            previous, self._pending = self._pending, self.outputs.launched(active, drawn[:, 0], kept,
                                                                    logprobs[:, 0] if logprobs is not None else None)
            if previous is not None:
                self.outputs.read(previous)

    def _propose(self) -> list[list[int]] | None:
        """This step's drafts for the running requests (`Proposer`); None where none wants to draft or none
        was found: the step is a plain one. The step in flight is read first where a draft may come (drafts
        continue the last token)."""
        wanted = self.proposer.wanted(self.scheduler.running)
        if not any(wanted.values()):
            return None
        if self._pending is not None:
            if not self.proposer.may_find(wanted, self.rows):
                return None
            with launching():
                self._drain()
        return self.proposer.drafts(self.scheduler.running, wanted, self.rows)

    def _settle(self, active: list[Request], drafts: list[list[int]], logits: Tensor) -> None:
        """A step that checked drafts: each row keeps its drafted tokens up to its first rejection plus the
        token drawn there, and its cache is rolled back by length (positions past the kept ones are written
        again later). The host waits for the step here."""
        self.verify_steps += 1
        kept_logits = logits.clone() if any(r.stream.logits is not None for r in active) else None
        drawn, kept, logprobs = self.sampler.draw(active, logits, 0, drafts)
        drawn, kept = drawn.tolist(), kept.tolist()
        logprobs = logprobs.cpu() if logprobs is not None else None
        for i, (r, draft) in enumerate(zip(active, drafts)):
            fed = [r.last_token, *draft]
            r.draws.skip(kept[i])
            r.draft.record(len(draft), kept[i] - 1)
            r.stream.stats.drafted_tokens += len(draft)
            r.stream.stats.accepted_tokens += kept[i] - 1
            self.drafted_tokens += len(draft)
            self.accepted_tokens += kept[i] - 1
            for j in range(kept[i]):
                if r.row < 0:  # ended by an earlier token of this step
                    break
                if r.stream.cancelled:
                    self.outputs.finish(r, r.stream.reason)
                    break
                if r.grammar is not None:
                    r.grammar.consume(drawn[i][j])
                self.rows.append(r.row, fed[j])
                r.position += 1
                self.rows[r.row].written = r.position
                self.outputs.deliver(r, drawn[i][j], kept_logits[i, j] if kept_logits is not None else None,
                              logprobs[i, j] if logprobs is not None else None)

    def _drain(self) -> None:
        if self._pending is not None:
            step, self._pending = self._pending, None
            self.outputs.read(step)

