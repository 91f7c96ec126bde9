"""The torch LLM engine: one thread that serves many chats at once behind the `LLMEngine` seam
(`pipeline.llm.engine.seam`).

`TorchLLMEngine` works like a serving engine (vLLM, TensorRT-LLM's executor): one engine thread runs
continuous batching over four parts, each testable alone: the `Scheduler` (which requests wait, which
read their prompts and which run, in which cache rows, and each step's token budget), `CacheRows` (the
static KV cache and what each row holds, found by content through block hashes: token ids, and image
slots by the image's hash), the `ModelRunner` (the decoder, its rotary tables and CUDA graphs) and the
`Sampler` (the next-token draw with its biases, grammar masks, penalties and log-probabilities). This
module keeps the loop and each request's life. A joining request reads its prompt in chunks under
each step's token budget, between the decode steps of the running requests, and then joins them;
every decode step advances all running requests together, each at its own position with its own
sampling parameters and random stream; finished or cancelled requests leave at once. A row keeps
its tokens after a reply, and a new request runs in the idle row holding the longest prefix of it, so
a conversation's next turn prefills only what is new whoever sends it: the UI, an API client that
resends the whole conversation, the terminal chat. A session name only breaks ties. Idle rows are
reclaimed least recently used. With `speculation` (`speculation.py`), a step where requests drafted
tokens is a verify step (`_verify_step`); rows without drafts take part as one position.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from pipeline.errors import UserError
from pipeline.llm.engine.cache_rows import CacheRows
from pipeline.llm.engine.seam import FinishReason, TokenStream
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.text.grammar import Grammar
from pipeline.llm.model import Decoder
from pipeline.llm.engine.model_runner import ModelRunner
from pipeline.llm.engine.sampler import Sampler, logprobs_of
from pipeline.llm.engine.sampling import Draws, InvalidSampling, SamplingParams
from pipeline.llm.engine.scheduler import Request, Scheduler
from pipeline.llm.engine.speculation import DRAFT_SIZES, DraftState, Speculation, StepClock


@dataclasses.dataclass
class _Step:
    """A launched decode step, or the first draw of a request whose prompt is read: who ran in it, the
    drawn tokens (on the device and, once `copied` is done, on the host, with their log-probabilities
    where asked for), and the logits where a request keeps them. `consumed`: its tokens have advanced
    the requests' grammars."""

    requests: list[Request]
    drawn: Tensor
    logits: Tensor | None
    logprobs: Tensor | None
    copied: tuple[Tensor, "torch.cuda.Event | None"]
    consumed: bool = False


class TorchLLMEngine:
    """Continuous batching over a static KV cache; see the module docstring.

    `max_batch` (a power of two) requests decode together; `rows` cache rows (≥ max_batch) keep
    idle sessions' turns for reuse. Decode steps replay a CUDA graph per (batch bucket, context
    bucket) on a GPU and run eagerly on the CPU. `prefill_chunk`: each step's token budget while
    requests run, shared by their decodes and the prompt chunks of joining ones (None or 0: a joining
    prompt is read whole at once, stalling the running requests meanwhile). With 256, while a 4,000-token
    prompt joins 7 chats at Qwen2.5-7B's shapes on an H100, a running chat waits at most ~3 decode steps
    for a token instead of ~14, and the prompt's first token comes in ~290 ms instead of ~110
    (`bench/chunked_prefill.py`; on a GPU the chunks replay CUDA graphs, `ModelRunner._chunk`).
    """

    def __init__(self, model: Decoder, context: int, vocab_size: int, max_batch: int = 8, rows: int | None = None,
                 use_cuda_graphs: bool | None = None, prefill_chunk: int | None = 256,
                 speculation: Speculation | None = None):
        if max_batch < 1 or max_batch & (max_batch - 1):
            raise ValueError(f"max_batch must be a power of two, got {max_batch}")
        c = model.config
        if context > c.max_position_embeddings:
            raise UserError(f"context {context} exceeds the model's {c.max_position_embeddings} positions")
        self.context, self.vocab_size, self.max_batch = context, vocab_size, max_batch
        self.device, self.hidden_size = model.embed.weight.device, c.hidden_size
        rows = max(rows or 2 * max_batch, max_batch)
        self.runner = ModelRunner(model, context, vocab_size, max_batch, use_cuda_graphs)
        self.rows = CacheRows(c, rows, self.runner.positions, vocab_size, model.embed.weight.dtype, self.device)
        self.scheduler = Scheduler(max_batch, self.rows, prefill_chunk)
        self.sampler = Sampler(self.rows, vocab_size, max_batch, self.device)
        self._pending: _Step | None = None  # the decode step in flight, its tokens not yet read
        self._starting: list[_Step] = []  # first tokens drawn after prompts' last chunks, read a step later
        self.speculation = speculation
        self.step_cost = speculation and (StepClock(speculation.cost) if speculation.measured else speculation.cost)
        self._plain_since: tuple[float, int] | None = None  # when the plain step before started (and captures then)
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
            while (joining := scheduler.next_joining()) is not None:
                for request in joining:
                    self._guarded([request], self._admit, request)
                if any(r.stream.cancelled for r in scheduler.running):
                    self._guarded(list(scheduler.running), self._drain)  # settle the step in flight first
                for r in [r for r in scheduler.running + scheduler.prefilling if r.stream.cancelled]:
                    self._finish(r, r.stream.reason)
                self._guarded(list(scheduler.running), self._decode_step)
                starting, self._starting = self._starting, []
                for step in starting:
                    self._guarded(step.requests, self._read, step, True)
                for request, end in scheduler.chunks():
                    self._guarded([request], self._prefill, request, end)
            self._pending, self._starting = None, []
            for request in scheduler.drop_all():
                self._finish(request, FinishReason.CANCELLED)

    def _guarded(self, requests: list[Request], fn: Callable, *args) -> None:
        """Run `fn`; if it fails, the requests involved end with the error and the engine carries on
        (the decode step in flight is dropped where they ran in it: its state is unknown)."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to the callers, who raise it
            if isinstance(e, torch.OutOfMemoryError):
                e = UserError("the GPU ran out of memory for this reply: shorten the conversation "
                              "or lower max new tokens")
            if self._pending is not None and set(requests) & set(self._pending.requests):
                self._pending = None
            for request in requests:
                request.stream.deliver(e)
                self._finish(request, FinishReason.ERROR)

    def _admit(self, request: Request) -> None:
        """Give a new request a row, the one holding the longest cached prefix of its prompt: its
        prompt is read from there, chunk by chunk (`_prefill`)."""
        if request.stream.cancelled:
            self._finish(request, request.stream.reason)
            return
        sig = request.prompt.signature()
        request.table = self.runner.rope.table_for(len(sig))
        reused = min(self.scheduler.place(request, sig), len(sig) - 1)  # the last token must run for its logits
        self.rows.hold(request.row, sig[:reused], request.table, request.session)
        request.position = self.rows[request.row].written = reused
        request.stream.stats.cached_tokens = reused
        self.reused_tokens += reused

    def _prefill(self, request: Request, end: int) -> None:
        """Read the request's prompt up to position `end`; at its end, draw its first token, read at the
        next step (as a decode step's tokens are: the host does not wait for this chunk), when the request
        joins the running ones."""
        last = end == len(request.sig)
        logits = self.runner.prefill(self.rows.kv, request.prompt, request.row, request.position, end,
                                     request.table, logits=last, graphed=bool(self.scheduler.running))
        self.prefilled_tokens += end - request.position
        request.position = self.rows[request.row].written = end
        if not last:
            return
        self.rows.hold(request.row, request.sig, request.table, request.session)
        self.sampler.start(request)
        drawn, logprobs = self.sampler.draw([request], logits[None], request.row)
        kept = logits[None] if request.stream.logits is not None else None
        self._starting.append(self._launched([request], drawn, kept, logprobs))

    def _decode_step(self) -> None:
        """Launch a decode step for every running request, then read the previous step's tokens
        while the GPU works on this one. While the batch stays the same, a step's inputs (the tokens
        just drawn, positions one further) are made on the GPU, so the host never stalls it. When the
        batch changed (a request joined or left), the step in flight is read first: the inputs come from
        the host."""
        if self._pending is not None and self._pending.requests != self.scheduler.running:
            self._drain()
        active = list(self.scheduler.running)
        if not active:
            return
        if self.speculation is not None and self._speculate(active):
            return
        active = list(self.scheduler.running)  # a verify step's reading may have ended some
        if not active:
            return
        chained = self._pending is not None
        if isinstance(self.step_cost, StepClock):  # a step that captured a graph (first use of a length) is no sample
            now = (time.perf_counter(), self.runner.captures)
            if chained and self._plain_since is not None and self._plain_since[1] == now[1]:
                self.step_cost.plain(now[0] - self._plain_since[0])
            self._plain_since = now
        inputs = None if chained else ([r.last_token for r in active], [r.position for r in active],
                                       [r.table for r in active])
        logits = self.runner.decode(self.rows.kv, len(active), inputs, self._pending.drawn if chained else None,
                                    max(r.position for r in active) + 1)
        self.steps += 1
        for r in active:
            r.position += 1
            self.rows[r.row].written = r.position
        if self._pending is not None and any(r.grammar is not None for r in active):
            self._consume(self._pending)  # this step's masks need the last tokens (the GPU runs the forward meanwhile)
        kept = logits.clone() if any(r.stream.logits is not None for r in active) else None  # graphs reuse theirs
        drawn, logprobs = self.sampler.draw(active, logits, 0)
        previous, self._pending = self._pending, self._launched(active, drawn, kept, logprobs)
        if previous is not None:
            self._read(previous)

    def _speculate(self, active: list[Request]) -> bool:
        """Run this step as a verify step where any request drafts tokens (see `speculation`): the step in
        flight is read first (drafts continue the last token). False where none wants to draft, or none
        found a draft: the step is a plain decode step."""
        most = self.speculation.max_draft
        wanted = {r: r.draft.wanted(self.step_cost, most, self._draft_room(r)) for r in active}
        if not any(wanted.values()):
            return False
        if self._pending is not None:  # look without the token in flight first: reading it stalls the GPU
            if not self.speculation.drafter.always and not any(
                    k and r.draft.drafts.propose(self.rows[r.row].held, 1, (r.last_token,)) for r, k in wanted.items()):
                return False
            self._drain()
            self._plain_since = None
        started, captures = time.perf_counter(), self.runner.captures
        active = list(self.scheduler.running)  # the tokens read may have ended some
        drafts = [self._draft(r, wanted[r]) if wanted[r] else [] for r in active]
        if not any(drafts):
            return False
        size = self._verify_step(active, drafts)
        if isinstance(self.step_cost, StepClock) and self.runner.captures == captures:
            self.step_cost.verify(size - 1, time.perf_counter() - started)
        return True

    def _draft_room(self, r: Request) -> int:
        """Tokens `r` may draft: what its reply's length and the context leave after this step's own token."""
        return min(r.params.max_new_tokens - r.stream.stats.new_tokens, self.context - r.position) - 1

    def _draft(self, r: Request, k: int) -> list[int]:
        """Up to `k` tokens drafted for `r` (none where `k` is 0): cut after a stop id, and where `r` has a
        grammar, to what it allows before any stop id (its masks are made through the draft)."""
        if r.row < 0:
            return []
        draft = r.draft.drafts.propose(self.rows[r.row].held, min(k, self._draft_room(r)), (r.last_token,))
        ends = [i for i, t in enumerate(draft) if t in r.stop_ids]
        if r.grammar is not None:
            draft = draft[:ends[0] if ends else len(draft)]
            return draft[:r.grammar.allowed_prefix(draft)]
        return draft[:ends[0] + 1] if ends else draft

    def _verify_step(self, active: list[Request], drafts: list[list[int]]) -> int:
        """Score each request's last token and its drafted ones in one forward, keep each row's drafted tokens
        up to its first rejection plus the token drawn there (`Sampler.verify_draw`), and roll the cache back
        by length: positions past the kept ones are written again later. Returns the positions scored per row."""
        size = next(k for k in DRAFT_SIZES if k >= max(map(len, drafts))) + 1
        tokens = [[r.last_token, *d, *[r.last_token] * (size - 1 - len(d))] for r, d in zip(active, drafts)]
        logits = self.runner.verify(self.rows.kv, tokens, [r.position for r in active], [r.table for r in active])
        self.steps += 1
        self.verify_steps += 1
        kept_logits = logits.clone() if any(r.stream.logits is not None for r in active) else None
        drawn, kept, logprobs = self.sampler.verify_draw(active, logits, drafts)
        drawn, kept = drawn.tolist(), kept.tolist()  # the host waits for the step here
        logprobs = logprobs.cpu() if logprobs is not None else None
        for i, (r, draft) in enumerate(zip(active, drafts)):
            r.draws.skip(kept[i])
            r.draft.record(len(draft), kept[i] - 1)
            r.stream.stats.drafted_tokens += len(draft)
            r.stream.stats.accepted_tokens += kept[i] - 1
            self.drafted_tokens += len(draft)
            self.accepted_tokens += kept[i] - 1
            fed = tokens[i]
            for j in range(kept[i]):
                if r.row < 0:  # ended by an earlier token of this step
                    break
                if r.stream.cancelled:
                    self._finish(r, r.stream.reason)
                    break
                if r.grammar is not None:
                    r.grammar.consume(drawn[i][j])
                self.rows.append(r.row, fed[j])
                r.position += 1
                self.rows[r.row].written = r.position
                self._deliver(r, drawn[i][j], kept_logits[i, j] if kept_logits is not None else None,
                              logprobs[i, j] if logprobs is not None else None)
        return size

    def _launched(self, requests: list[Request], drawn: Tensor, kept: Tensor | None,
                  logprobs: Tensor | None) -> _Step:
        """A step whose tokens `drawn` (and log-probabilities) start their way to the host."""
        if logprobs is not None:
            logprobs = logprobs.to("cpu", non_blocking=True)  # pinned: ready with the tokens' copy
        return _Step(requests, drawn, kept, logprobs, self.runner.to_host(drawn))

    def _drain(self) -> None:
        if self._pending is not None:
            step, self._pending = self._pending, None
            self._read(step)

    def _consume(self, step: _Step) -> None:
        """Advance the grammars of a step's requests by the tokens it drew (once per step)."""
        if step.consumed:
            return
        step.consumed = True
        host, done = step.copied
        if done is not None:
            done.synchronize()
        for r, token in zip(step.requests, host.tolist()):
            if r.grammar is not None and r.row >= 0 and not r.stream.cancelled:
                r.grammar.consume(token)

    def _read(self, step: _Step, starting: bool = False) -> None:
        """Hand out a finished step's tokens to the requests still running (`starting`: their first
        tokens, with which they join the running ones)."""
        self._consume(step)
        host, _ = step.copied
        rows = step.logits if step.logits is not None else [None] * len(step.requests)
        logprobs = step.logprobs if step.logprobs is not None else [None] * len(step.requests)
        for r, token, row_logits, row_logprobs in zip(step.requests, host.tolist(), rows, logprobs):
            if r.row < 0:  # finished while this step ran
                continue
            if r.stream.cancelled:
                self._finish(r, r.stream.reason)
                continue
            if starting:
                self.scheduler.promote(r)
            else:
                self.rows.append(r.row, r.last_token)
            self._deliver(r, token, row_logits, row_logprobs)

    def _deliver(self, r: Request, token: int, logits: Tensor | None, logprobs: Tensor | None = None) -> None:
        """Hand `token` to its request, or end the request (a stop id, its length, the context end)."""
        stats = r.stream.stats
        now = time.perf_counter()
        if r.stream.logits is not None:
            r.stream.logits.append(logits.float().cpu())
        if r.stream.logprobs is not None and token not in r.stop_ids:
            r.stream.logprobs.append(logprobs_of(logprobs, r.params.logprobs))
        if not r.first_token_at:
            r.first_token_at = now
            stats.time_to_first_token_s = now - r.submitted
        stats.decode_s = now - r.first_token_at
        if token in r.stop_ids:
            self._finish(r, FinishReason.STOP)
            return
        stats.new_tokens += 1
        r.last_token = token
        r.stream.deliver(token)
        if stats.new_tokens >= r.params.max_new_tokens:
            self._finish(r, FinishReason.LENGTH)
        elif len(self.rows[r.row].held) + 1 >= self.context:
            self._finish(r, FinishReason.CONTEXT)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """End a request: its row, holding its tokens for whoever continues them, leaves the block of rows
        in use; then its stream closes."""
        self.scheduler.leave(request, error=reason == FinishReason.ERROR)
        request.stream.end(reason)

