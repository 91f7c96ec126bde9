"""The torch LLM engine: one thread that serves many chats at once behind the `LLMEngine` seam
(`pipeline.llm.engine.seam`).

`TorchLLMEngine` works like a serving engine (vLLM v1, TensorRT-LLM's executor): one engine thread runs
continuous batching over four parts, each testable alone: the `Scheduler` (which requests wait, read their
prompts or run, in which cache rows, and each step's token budget), `CacheRows` (the static KV cache and
what each row holds, found by content through block hashes), the `ModelRunner` (the decoder, its rotary
tables and CUDA graphs) and the `Sampler` (every draw, with biases, grammar masks, penalties and
log-probabilities). This module keeps the loop and each request's life.

There is one kind of step (`_step`), planned as data (`Scheduler.plan` → `StepPlan`): under one token
budget, every running request feeds its last token (and, speculating, the tokens drafted after it:
`speculation.py`, asked of the drafter once for all rows), and requests reading their prompts feed chunks of
them, shared fairly; one forward runs it all, one draw takes every drawn position (a prompt's last one too)
and one routine settles the step (`Outputs.settle`), a step later: the host reads a step's tokens while the
GPU runs the next, whose inputs, after a step of the same rows (one that checked drafts too), are the last tokens
kept on the GPU, at positions moved by the counts kept there (a step that drafts reads the one in flight first:
`Scheduler.plan`). A prompt's last chunk draws its first token, and the request joins the running ones. Finished or cancelled requests
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
from pipeline.llm.engine.plan import Request, StepPlan
from pipeline.llm.engine.scheduler import Proposer, Scheduler
from pipeline.llm.engine.speculation import Speculation, costs_on

LONE = 8  # a prompt read with no request running goes in chunks of LONE × prefill_chunk (1,024 by default)


class TorchLLMEngine:
    """Continuous batching over a static KV cache; see the module docstring.

    `max_batch` (a power of two) requests decode together; `rows` cache rows (≥ max_batch) keep idle sessions'
    turns for reuse. On a GPU steps replay CUDA graphs, all captured as the engine starts (`ModelRunner.
    table_keys`). `prefill_chunk`: each step's token budget while requests run, shared by their decodes and
    the prompt chunks of joining ones (128: the running chats' largest gap while an 8th reads 4,000 tokens is
    1.59× their step at 7B on an H200, 2.28× with 256; `bench/chunked_prefill.py`); with none running, prompts
    are read in chunks LONE times as long, so a short prompt that joins waits for one such chunk and a short
    step, not for a long prompt's whole read (None or 0: a joining prompt is read whole, stalling the others)."""

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
        self.proposer = Proposer(speculation, context) if speculation is not None else None
        verifying = min(speculation.max_rows, max_batch) if speculation else 1  # rows a verify step may have
        self.runner = ModelRunner(model, context, vocab_size, max_batch, use_cuda_graphs,
                                  self.proposer.widths if self.proposer else (1,), verifying,
                                  exact_rows=speculation is None or speculation.exact, step_tokens=prefill_chunk)
        self.rows = CacheRows(c, rows, self.runner.positions, vocab_size, model.norm.weight.dtype, self.device)
        self.scheduler = Scheduler(max_batch, self.rows, prefill_chunk, prefill_chunk and LONE * prefill_chunk,
                                   self.proposer, max_batch if self.runner.use_cuda_graphs else None)
        self.sampler = Sampler(self.rows, vocab_size, max_batch, self.device, self.runner.widths[-1])
        self.outputs = Outputs(self.scheduler, self.rows, context, self.runner.to_host)
        self._pending: Launched | None = None  # the step in flight, its tokens not yet settled
        self.speculation = speculation
        self.steps = self.verify_steps = 0  # decode steps run, verify steps among them (for tests and benchmarks)
        self.prefilled_tokens = self.reused_tokens = 0  # prompt positions computed, and found in the cache
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
        self.scheduler.add(Request(prompt, params, set(stop_ids), session, stream, Draws(params.seed),
                                   time.perf_counter(), grammar))
        return stream

    def status(self) -> dict[str, int]:
        """What the engine is doing now (for the UI and tests): requests running and queued, and so on."""
        return {**self.scheduler.status(), "decode_steps": self.steps, "prefilled_tokens": self.prefilled_tokens,
                "reused_tokens": self.reused_tokens, "verify_steps": self.verify_steps}

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
        """The engine thread. Where it fails past the guards of the requests' own work (a CUDA error setting up
        its thread), every request, queued or to come, is told why rather than left waiting for ever."""
        try:
            self._serve()
        except Exception as e:  # noqa: BLE001 - said to every request; the app's other tools go on
            error = UserError(f"the language model stopped ({type(e).__name__}: {e}); restart the app")
            self.scheduler.close(str(error))
            for request in self.scheduler.drop_all():
                request.stream.deliver(error)
                self.outputs.finish(request, FinishReason.ERROR)

    def _serve(self) -> None:
        self.runner.enter_thread()
        scheduler = self.scheduler
        with torch.inference_mode():
            if self.use_cuda_graphs:  # every step's graph before the first request: none is captured mid-reply
                try:
                    self.runner.capture_table(self.rows.kv)
                except Exception as e:  # noqa: BLE001 - the steps the table lacks run eagerly: slower, as right
                    warnings.warn(f"capturing the step graphs failed ({type(e).__name__}: {e}); the steps without "
                                  f"one run without CUDA graphs", stacklevel=1)
                    self.runner.ready = True
            if self.speculation is not None and self.device.type == "cuda":
                try:
                    self._measure()
                except Exception as e:  # noqa: BLE001 - the prior costs serve; the steps capture at first use
                    warnings.warn(f"measuring the verify steps failed ({type(e).__name__}: {e}); speculation "
                                  f"takes the prior costs", stacklevel=1)
            while (joining := scheduler.next_joining()) is not None:
                for request in joining:
                    self._guarded([request], self._admit, request)
                if any(r.stream.cancelled for r in scheduler.running):
                    self._guarded(list(scheduler.running), self._drain)  # settle the step in flight first
                for r in [r for r in scheduler.running + scheduler.prefilling if r.stream.cancelled]:
                    self.outputs.finish(r, r.stream.reason)
                self._guarded(scheduler.running + scheduler.prefilling, self._step)
            self._pending = None
            for request in scheduler.drop_all():
                self.outputs.finish(request, FinishReason.CANCELLED)

    def _measure(self) -> None:
        """The verify costs on this GPU (`speculation.costs_on`): those an earlier launch recorded, else measured
        now on the steps the graph table holds, one row and the most rows that verify."""
        costs = costs_on(self.speculation, lambda rows, k, settled: self.runner.step_seconds(
            self.rows.kv, rows, k + 1, settled), sorted({1, self.runner.wide_rows}))
        self.proposer.costs = costs or self.proposer.costs

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
        """One engine step: the plan (`Scheduler.plan`, drafts included), one forward and one draw over all of
        it; then the step before is settled while the GPU runs this one. The host stays at most one step ahead
        of the GPU."""
        running = self.scheduler.running
        pending = self._pending
        # a step chains on the one in flight where that ran the same rows (a grammar's drafts need its tokens first)
        if pending is not None and ([s.request for s in pending.plan.rows] != running or not running or
                                    self.proposer is not None and any(r.grammar is not None for r in running)):
            self._drain()  # else this step's inputs come from the host (nothing runs: nothing to overlap)
        plan = self.scheduler.plan(self._pending.plan if self._pending is not None else None, self._drain)
        if plan.rows or plan.chunks:
            try:
                self._launch(plan)
            except Exception as e:  # noqa: BLE001 - a step that read prompts: theirs end, the running take it again
                if not plan.chunks:
                    raise
                self._fail([s.request for s in plan.chunks], e)
                self._drain()  # the rows were not advanced: their next step starts from the host
            self.runner.one_step_ahead()

    def _offset(self, request: Request, position: int) -> int:
        """The rotary offset of `request`'s tokens from `position` on: its table's, moved by its prompt's
        M-RoPE shift there (0 but for Qwen2.5-VL's pictures)."""
        return self.runner.rope.offset(request.table, request.prompt.shift(position))

    def _launch(self, plan: StepPlan) -> None:
        """Run `plan` in one forward: rows 0..n-1 feed their last token and drafts (padded to a draft size; chained on
        the GPU after the step in flight, the last token and positions are that step's); the chunks are read beside
        them. Every drawn position is drawn in one call, and the step's tokens start their way to the host."""
        rows, chunks = plan.rows, plan.chunks
        feed = behind = None
        if rows:
            size = rows[0].width
            fed = [[s.request.last_token, *s.proposed, *[s.request.last_token] * (size - s.size)] for s in rows]
            feed = RowsFeed(len(rows), fed, [s.start for s in rows], [self._offset(s.request, s.start) for s in rows],
                            self._pending.chained if rows[0].chained else None, max(s.start for s in rows) + size)
            if rows[0].chained and self._pending.plan.verifies:  # each row's draws start where that step's ended
                behind = self._pending.chained[1], self._pending.plan.rows[0].width
        reads = [ChunkRead(s.request.prompt, s.request.row, s.start, s.end, self._offset(s.request, s.start), s.last)
                 for s in chunks]
        logits, firsts = self.runner.step(self.rows.kv, feed, reads, graphed=bool(rows))
        self.steps += bool(rows)
        self.verify_steps += plan.verifies
        for s in rows + chunks:  # the positions fed are written (a row's rejected drafts are rolled back at settling)
            s.request.position = self.rows[s.request.row].written = s.end
        self.prefilled_tokens += sum(s.size for s in chunks)
        drawing = plan.drawing
        if not drawing:  # prompt chunks alone, none of them a prompt's last
            return
        for s in drawing[len(rows):]:
            r = s.request
            self.rows.hold(r.row, r.sig, r.table, r.session)
            self.sampler.start(r)
        if firsts:
            width = logits.shape[1] if logits is not None else 1
            firsts = torch.stack(firsts)[:, None].expand(-1, width, -1)
            logits = firsts if logits is None else torch.cat([logits, firsts])
        if self._pending is not None and any(s.request.grammar is not None for s in rows):
            self.outputs.consume(self._pending)  # this step's masks need the last tokens (the GPU runs the forward meanwhile)
        kept_logits = logits.clone() if any(s.request.stream.logits is not None for s in drawing) else None  # graphs reuse theirs
        drawn, kept, logprobs = self.sampler.draw([s.request for s in drawing], logits, [s.proposed for s in drawing],
                                                  behind)
        for s in drawing:
            s.request.draws.skip(1)
        previous, self._pending = self._pending, self.outputs.launched(plan, drawn, kept, kept_logits, logprobs)
        if previous is not None:
            self.outputs.settle(previous)

    def _drain(self) -> None:
        """Settle the step in flight now (waiting for the GPU)."""
        if self._pending is not None:
            step, self._pending = self._pending, None
            self.outputs.settle(step)

