"""The LLM engine seam, and the torch engine that serves many chats at once.

Pipelines hand an engine a `Prompt` (token ids, plus embeddings for marked slots: image chat's
query embeddings), `SamplingParams`, stop ids and optionally a session name; they get back a
`TokenStream` of token ids that they iterate, and can cancel, from any thread. Everything above
this seam (prompt formats, context fitting, UTF-8-safe text) is the same for every backend.

`TorchLLMEngine` works like a serving engine (vLLM, TensorRT-LLM's executor): one engine thread runs
continuous batching over three parts, each testable alone: the `Scheduler` (which requests wait and
which run, in cache rows 0..B-1), `CacheRows` (the static KV cache and what each row holds, found
by content through block hashes: token ids, and image slots by the image's hash) and the
`ModelRunner` (the decoder, its rotary tables, CUDA graphs and the next-token draw). New requests
are prefilled and join the running batch; every decode step advances all running requests
together, each at its own position with its own sampling parameters and random stream; finished or
cancelled requests leave at once. A row keeps its tokens after a reply, and a new request runs in
the idle row holding the longest prefix of it, so a conversation's next turn prefills only what is
new whoever sends it: the UI, an API client that resends the whole conversation, the terminal
chat. A session name only breaks ties. Idle rows are reclaimed least recently used.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor

from pipeline.errors import UserError
from pipeline.llm.cache_rows import CacheRows
from pipeline.llm.grammar import Grammar, apply_masks, bitmask_words, fill_masks
from pipeline.llm.model import Decoder
from pipeline.llm.model_runner import ModelRunner
from pipeline.llm.sampling import Draws, InvalidSampling, SamplingParams, counts_penalized
from pipeline.llm.scheduler import Request, Scheduler


@dataclasses.dataclass(frozen=True)
class Prompt:
    """Token ids, where `slots` ((start, length) runs) take their inputs from `embeds` instead.

    Ids inside a slot are placeholders. `keys` name each slot's content (an image hash) so an
    engine can recognise a cached prefix that includes it.
    """

    ids: tuple[int, ...]
    slots: tuple[tuple[int, int], ...] = ()
    embeds: tuple[Tensor, ...] = ()
    keys: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.ids)

    def fill(self, embeds: Tensor, key: str) -> "Prompt":
        """Every slot filled with `embeds` [length, hidden] (MiniGPT-4 shows one image per prompt)."""
        for _, length in self.slots:
            if length != embeds.shape[0]:
                raise ValueError(f"a slot of {length} positions cannot hold {embeds.shape[0]} embeddings")
        return dataclasses.replace(self, embeds=(embeds,) * len(self.slots), keys=(key,) * len(self.slots))

    def signature(self) -> list:
        """What identifies each position's input: its id, or (content key, offset) inside a slot."""
        sig: list = list(self.ids)
        for (start, length), key in zip(self.slots, self.keys):
            sig[start:start + length] = [(key, i) for i in range(length)]
        return sig


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose cache entries were found in a row (an earlier turn's)
    new_tokens: int = 0
    time_to_first_token_s: float = 0.0  # from submission, queueing included
    decode_s: float = 0.0
    finish_reason: str = ""  # "stop" | "length" | "context" | "cancelled"

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    def summary(self, context: int = 0) -> str:
        """A reply's speed and size, and how full the context is (`context` 0: unknown, a remote model):
        the one statistics line of the UI and the terminal chat."""
        cached = f" ({self.cached_tokens} found in the cache)" if self.cached_tokens else ""
        meter = f" · context: {self.prompt_tokens + self.new_tokens} of {context} tokens" if context else ""
        return (f"{self.new_tokens} tokens · {self.tokens_per_s:.1f} tok/s · first token "
                f"{self.time_to_first_token_s * 1000:.0f} ms · prompt {self.prompt_tokens} tokens{cached} · "
                f"ended: {self.finish_reason}{meter}")


_END = object()


class TokenStream:
    """One request's token ids as the engine produces them. Iterate to receive them (the iteration
    ends when the request finishes; `stats` then holds its finish reason); `cancel` ends the request
    at the engine's next step. Several threads may cancel; one consumes."""

    def __init__(self, cancel: threading.Event | None, keep_logits: bool, logprobs: bool = False):
        self.stats = GenerationStats()
        self.logits: list[Tensor] | None = [] if keep_logits else None  # per token, fp32 on the CPU
        # per token, before it is delivered: (its log-probability, [(id, log-probability)] most likely first)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] | None = [] if logprobs else None
        self._cancel = cancel if cancel is not None else threading.Event()
        self.reason = "cancelled"  # what a cancelled request's finish reason will be
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._ended = False

    def __iter__(self) -> Iterator[int]:
        while not self._ended:
            item = self._items.get()
            if item is _END:
                self._ended = True
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def deliver(self, item: int | BaseException) -> None:
        """Engine side: hand over the next token id, or the error that ends the request."""
        self._items.put(item)

    def end(self, reason: str) -> None:
        """Engine side: the request is over (a reason set by `cancel` or an earlier error wins)."""
        self.stats.finish_reason = self.stats.finish_reason or reason
        self._items.put(_END)

    def cancel(self, reason: str = "cancelled") -> None:
        """End the request; `reason` becomes its finish reason ("stop" when a stop string was seen)."""
        self.reason = reason
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self) -> GenerationStats:
        """Drain the stream; the final statistics."""
        for _ in self:
            pass
        return self.stats


class LLMEngine(Protocol):
    """What every LLM backend offers the pipelines."""

    context: int  # positions a sequence may use: prompt and reply together
    vocab_size: int  # the width of the logits (grammars mask this many tokens)
    hidden_size: int  # the width of the embeddings a prompt's slots take
    description: str

    def submit(self, prompt: Prompt, params: SamplingParams, stop_ids: set[int], session: str | None = None,
               cancel: threading.Event | None = None, keep_logits: bool = False,
               grammar: Grammar | None = None) -> TokenStream: ...

    def status(self) -> dict[str, int]: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class _Step:
    """A launched decode step: who ran in it, the drawn tokens (on the device and, once `copied`
    is done, on the host, with their log-probabilities where asked for), and the logits where a
    request keeps them. `consumed`: its tokens have advanced the requests' grammars."""

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
    bucket) on a GPU and run eagerly on the CPU.
    """

    def __init__(self, model: Decoder, context: int, vocab_size: int, max_batch: int = 8, rows: int | None = None,
                 use_cuda_graphs: bool | None = None):
        if max_batch < 1 or max_batch & (max_batch - 1):
            raise ValueError(f"max_batch must be a power of two, got {max_batch}")
        c = model.config
        if context > c.max_position_embeddings:
            raise UserError(f"context {context} exceeds the model's {c.max_position_embeddings} positions")
        self.context, self.vocab_size, self.max_batch = context, vocab_size, max_batch
        self.device, self.hidden_size = model.embed.weight.device, c.hidden_size
        rows = max(rows or 2 * max_batch, max_batch)
        self.runner = ModelRunner(model, context, vocab_size, max_batch, use_cuda_graphs)
        self.rows = CacheRows(c, rows, context + 1, vocab_size, model.embed.weight.dtype, self.device)
        self.scheduler = Scheduler(max_batch, self.rows)
        self._pending: _Step | None = None  # the decode step in flight, its tokens not yet read
        self._bitmask: Tensor | None = None  # grammar masks on the host, two steps' worth (made at first use)
        self._flip_mask = 0
        self.steps = 0  # decode steps run (for tests and benchmarks)
        self.prefilled_tokens = self.reused_tokens = 0  # prompt positions computed, and found in the cache
        self.description = (f"torch{' (CUDA graphs)' if self.use_cuda_graphs else ''} · batch up to {max_batch} · "
                            f"{rows} cache rows of {context} tokens")
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
        params = params.validated()
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
                "reused_tokens": self.reused_tokens}

    def close(self) -> None:
        """Stop the engine thread (queued and running requests end "cancelled") and let go of the model,
        its cache and its graphs, so an unloaded tool's memory is freed."""
        self.scheduler.close()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.runner.close()
            self.rows.kv = self.rows.seen = self.rows.counts = self._pending = None

    # ---- the engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        self.runner.enter_thread()
        running = self.scheduler.running
        with torch.inference_mode():
            while (joining := self.scheduler.next_joining()) is not None:
                if joining or any(r.stream.cancelled for r in running):
                    self._guarded(list(running), self._drain)  # the batch changes: settle the step in flight
                    for request in joining:
                        self._guarded([request], self._admit, request)
                    for r in [r for r in running if r.stream.cancelled]:
                        self._finish(r, r.stream.reason)
                self._guarded(list(running), self._decode_step if running else self._drain)
            self._pending = None
            for request in self.scheduler.drop_all():
                self._finish(request, "cancelled")

    def _guarded(self, requests: list[Request], fn, *args) -> None:
        """Run `fn`; if it fails, the requests involved end with the error and the engine carries on."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to the callers, who raise it
            if isinstance(e, torch.OutOfMemoryError):
                e = UserError("the GPU ran out of memory for this reply: shorten the conversation "
                              "or lower max new tokens")
            self._pending = None
            for request in requests:
                request.stream.deliver(e)
                self._finish(request, "error")

    def _admit(self, request: Request) -> None:
        """Prefill a new request in a row (reusing the longest cached prefix of its tokens) and emit its first token."""
        if request.stream.cancelled:
            self._finish(request, request.stream.reason)
            return
        prompt, sig = request.prompt, request.prompt.signature()
        request.table = self.runner.rope.table_for(len(prompt))
        reused = min(self.scheduler.place(request, sig), len(sig) - 1)  # the last token must run for its logits
        row = request.row
        self.rows.hold(row, sig[:reused], request.table, request.session)
        self.prefilled_tokens += len(sig) - reused
        self.reused_tokens += reused
        logits = self.runner.prefill(self.rows.kv, prompt, row, reused, request.table)
        self.rows.hold(row, sig, request.table, request.session)
        request.position = self.rows[row].written = len(sig)
        request.stream.stats.cached_tokens = reused
        seen = self.rows.seen
        seen[row] = False
        if counts_penalized([request.params]):
            self.rows.counts[row] = 0
        if not prompt.slots:  # as transformers does: the prompt's own ids count for the penalty
            seen[row, torch.tensor(prompt.ids, device=self.device)] = True
        if request.params.logit_bias:
            ids, biases = zip(*request.params.logit_bias)
            request.bias = torch.zeros(self.vocab_size, device=self.device).index_put_(
                (torch.tensor(ids, device=self.device),), torch.tensor(biases, device=self.device))
        drawn, logprobs = self._draw([request], logits[None], row)
        token = drawn.tolist()[0]
        if request.grammar is not None:
            request.grammar.consume(token)
        self._deliver(request, token, logits, None if logprobs is None else logprobs.cpu()[0])

    def _decode_step(self) -> None:
        """Launch a decode step for every running request, then read the previous step's tokens
        while the GPU works on this one. While the batch stays the same, a step's inputs (the tokens
        just drawn, positions one further) are made on the GPU, so the host never stalls it."""
        active = list(self.scheduler.running)
        chained = self._pending is not None and self._pending.requests == active
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
        drawn, logprobs = self._draw(active, logits, 0)
        if logprobs is not None:
            logprobs = logprobs.to("cpu", non_blocking=True)  # pinned: ready with the tokens' copy
        launched = _Step(active, drawn, kept, logprobs, self.runner.to_host(drawn))
        previous, self._pending = self._pending, launched
        if previous is not None:
            self._read(previous)
        if self.scheduler.running != active:  # some finished: settle this step before the batch changes
            self._drain()

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

    def _read(self, step: _Step) -> None:
        """Hand out a finished step's tokens to the requests still running."""
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
            self.rows.append(r.row, r.last_token)
            self._deliver(r, token, row_logits, row_logprobs)

    def _draw(self, requests: list[Request], logits: Tensor, first_row: int) -> tuple[Tensor, Tensor | None]:
        """Each request's next token (on the device) from its logits row, within its grammar if it has
        one, and where a request asks for them the log-probabilities (`_logprobs`); the requests run
        in the consecutive cache rows from `first_row`."""
        uniforms = [r.draws.next() for r in requests]  # drawn every step, so a request's stream never shifts
        rows = slice(first_row, first_row + len(requests))
        wanted = [r.params.logprobs for r in requests if r.params.logprobs is not None]
        # log-softmax of the model's own logits in fp32, before any sampling setting or grammar, as OpenAI reports them
        logprobs = logits.float().log_softmax(-1) if wanted else None
        allowed = _biased(requests, logits) if any(r.bias is not None for r in requests) else logits
        if any(r.grammar is not None for r in requests):
            allowed = self._masked(requests, allowed)
        drawn = self.runner.draw([r.params for r in requests], uniforms, allowed, self.rows.seen[rows],
                                 self.rows.counts[rows])
        return drawn, (_chosen_and_top(logprobs, drawn, max(wanted)) if wanted else None)

    def _masked(self, requests: list[Request], logits: Tensor) -> Tensor:
        """`logits` with each constrained row's forbidden tokens at -inf: the masks are made on the
        host, uploaded in one asynchronous copy and applied on the device (other rows stay as they were)."""
        if self._bitmask is None:
            self._bitmask = torch.zeros(2, self.max_batch, bitmask_words(self.vocab_size), dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        self._flip_mask ^= 1  # the other buffer's upload may still be queued
        host = self._bitmask[self._flip_mask, :len(requests)]
        fill_masks([r.grammar for r in requests], host)
        return apply_masks(logits, host.to(self.device, non_blocking=True))

    def _deliver(self, r: Request, token: int, logits: Tensor | None, logprobs: Tensor | None = None) -> None:
        """Hand `token` to its request, or end the request (a stop id, its length, the context end)."""
        stats = r.stream.stats
        now = time.perf_counter()
        if r.stream.logits is not None:
            r.stream.logits.append(logits.float().cpu())
        if r.stream.logprobs is not None and token not in r.stop_ids:
            values = logprobs.tolist()
            k = r.params.logprobs
            top = [(int(i), v) for v, i in zip(values[1:1 + k], values[(len(values) + 1) // 2:][:k])]
            r.stream.logprobs.append((values[0], top))
        if not r.first_token_at:
            r.first_token_at = now
            stats.time_to_first_token_s = now - r.submitted
        stats.decode_s = now - r.first_token_at
        if token in r.stop_ids:
            self._finish(r, "stop")
            return
        stats.new_tokens += 1
        r.last_token = token
        r.stream.deliver(token)
        if stats.new_tokens >= r.params.max_new_tokens:
            self._finish(r, "length")
        elif len(self.rows[r.row].held) + 1 >= self.context:
            self._finish(r, "context")

    def _finish(self, request: Request, reason: str) -> None:
        """End a request: its stream closes; its row, holding its tokens for whoever continues them, leaves
        the running block."""
        request.stream.end(reason)
        self.scheduler.leave(request, error=reason == "error")


def _biased(requests: list[Request], logits: Tensor) -> Tensor:
    """A copy of `logits` in fp32 with each request's `logit_bias` row added (OpenAI's: before any other
    sampling setting, so +100 all but forces a token and -100 all but bans it). The rows were made at
    admission: a step uploads nothing."""
    out = logits.to(torch.float32, copy=True)
    for i, r in enumerate(requests):
        if r.bias is not None:
            out[i] += r.bias
    return out


def _chosen_and_top(logprobs: Tensor, drawn: Tensor, k: int) -> Tensor:
    """Per row [the drawn token's log-probability, the k largest log-probabilities, their ids] (ids as
    floats: exact below 2^24), so one copy brings them to the host."""
    parts = [logprobs.gather(1, drawn[:, None])]
    if k:
        top = logprobs.topk(k, dim=-1)
        parts += [top.values, top.indices.float()]
    return torch.cat(parts, dim=1)
