"""The LLM engine seam, and the torch engine that serves many chats at once.

Pipelines hand an engine a `Prompt` (token ids, plus embeddings for marked slots: image chat's
query embeddings), `SamplingParams`, stop ids and optionally a session name; they get back a
`TokenStream` of token ids that they iterate, and can cancel, from any thread. Everything above
this seam (prompt formats, context fitting, UTF-8-safe text) is the same for every backend.

`TorchLLMEngine` works like a serving engine (vLLM, TensorRT-LLM's executor): one engine thread
owns the decoder, the KV cache (one row per sequence), the rotary tables and the CUDA graphs, and
runs continuous batching. New requests are prefilled and join the running batch; every decode step
advances all running requests together, each at its own position with its own sampling parameters
and random stream; finished or cancelled requests leave at once. Running requests always occupy
cache rows 0..B-1 (rows are swapped when one joins or leaves), so a step reads the cache as a plain
view. A row keeps its tokens after a reply, and a new request runs in the idle row that shares the
longest prefix with it, found by content (token ids, and image slots by the image's hash), so a
conversation's next turn prefills only what is new whoever sends it: the UI, an API client that
resends the whole conversation, the terminal chat. A session name only breaks ties. Idle rows are
reclaimed least recently used.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.cuda_graphs import CapturedCall
from pipeline.errors import UserError
from pipeline.llm.model import Decode, Decoder, KVCache, Prefill, RotaryTables
from pipeline.llm.sampling import COLUMNS, Draws, SamplingParams, sample, sampling_columns

GRAPH_BUCKET = 256  # decode graphs are captured for context lengths rounded up to this
# Prefill attention without cuDNN's kernel: it plans once per shape (~60 ms on an H100), and every
# turn of a conversation is a new shape (bench/sdpa_first_call.py); flash / memory-efficient plan nothing.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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

    def __init__(self, cancel: threading.Event | None, keep_logits: bool):
        self.stats = GenerationStats()
        self.logits: list[Tensor] | None = [] if keep_logits else None  # per token, fp32 on the CPU
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
    hidden_size: int  # the width of the embeddings a prompt's slots take
    description: str

    def submit(self, prompt: Prompt, params: SamplingParams, stop_ids: set[int], session: str | None = None,
               cancel: threading.Event | None = None, keep_logits: bool = False) -> TokenStream: ...

    def status(self) -> dict[str, int]: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class _Request:
    prompt: Prompt
    params: SamplingParams
    stop_ids: set[int]
    session: str | None
    stream: TokenStream
    draws: Draws
    submitted: float
    row: int = -1
    position: int = 0  # where the next fed token goes in the cache
    table: int = 0  # rotary table (Qwen v1 dynamic NTK)
    last_token: int = 0
    first_token_at: float = 0.0


@dataclasses.dataclass
class _Row:
    """What a cache row holds: the signature of the tokens in it, and whose session put them there (a hint)."""

    session: str | None = None
    held: list = dataclasses.field(default_factory=list)
    table: int = 0
    last_used: float = 0.0
    written: int = 0  # positions written so far, a step in flight included (what a move must copy)


@dataclasses.dataclass
class _Step:
    """A launched decode step: who ran in it, the drawn tokens (on the device and, once `copied`
    is done, on the host), and the logits where a request keeps them."""

    requests: list[_Request]
    drawn: Tensor
    logits: Tensor | None
    copied: tuple[Tensor, "torch.cuda.Event | None"]


def common_prefix(a: Sequence, b: Sequence) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


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
        weight = model.embed.weight
        self.model, self.context, self.vocab_size, self.max_batch = model, context, vocab_size, max_batch
        self.device, self.hidden_size = weight.device, c.hidden_size
        rows = max(rows or 2 * max_batch, max_batch)
        self.scratch = context  # padding rows of a bucketed step write here, a position no sequence uses
        self.cache = KVCache(c, rows, context + 1, weight.dtype, self.device)
        self.rope = RotaryTables(c, context + 1, self.device)
        self.seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=self.device)  # repetition penalty
        self.use_cuda_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self._graphs: dict[tuple[int, int], CapturedCall] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        # Per-step inputs go up in one pinned, non-blocking copy each, so the host never waits for
        # the GPU before the one synchronisation per step (reading the drawn tokens).
        pinned = self.device.type == "cuda"
        # Buffers that two steps may use at once (one running, one being prepared) come in pairs.
        self._step_host = torch.zeros(3, max_batch, dtype=torch.long, pin_memory=pinned)
        self._packed = torch.zeros(3, max_batch, dtype=torch.long, device=self.device)  # tokens, positions, tables
        self._draw_host = torch.zeros(2, len(COLUMNS), max_batch, dtype=torch.float32, pin_memory=pinned)
        self._draw_dev = torch.zeros(len(COLUMNS), max_batch, dtype=torch.float32, device=self.device)
        self._drawn_host = torch.zeros(2, max_batch, dtype=torch.long, pin_memory=pinned)
        self._flip = self._flip_columns = 0
        self._pending: _Step | None = None  # the decode step in flight, its tokens not yet read
        # Its own CUDA stream: a SAM click or an image encode on the default stream does not queue
        # behind decode steps already launched.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._rows = [_Row() for _ in range(rows)]
        self._active: list[_Request] = []  # _active[i] runs in cache row i
        self._waiting: list[_Request] = []
        self._wake = threading.Condition()
        self._closed = False
        self.steps = 0  # decode steps run (for tests and benchmarks)
        self.prefilled_tokens = self.reused_tokens = 0  # prompt positions computed, and found in the cache
        self.description = (f"torch{' (CUDA graphs)' if self.use_cuda_graphs else ''} · batch up to {max_batch} · "
                            f"{rows} cache rows of {context} tokens")
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    # ---- the seam ----------------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams, stop_ids: set[int], session: str | None = None,
               cancel: threading.Event | None = None, keep_logits: bool = False) -> TokenStream:
        """Queue a request; its tokens arrive on the returned stream. Raises `UserError` at once for
        a prompt that cannot fit."""
        params = params.validated()
        if not 0 < len(prompt) < self.context:
            raise UserError(f"a prompt of {len(prompt)} tokens does not fit the context of {self.context}")
        stream = TokenStream(cancel, keep_logits)
        stream.stats.prompt_tokens = len(prompt)
        request = _Request(prompt, params, set(stop_ids), session, stream, Draws(params.seed), time.perf_counter())
        with self._wake:
            if self._closed:
                raise UserError("the language model was unloaded; reload the page")
            self._waiting.append(request)
            self._wake.notify()
        return stream

    def status(self) -> dict[str, int]:
        """What the engine is doing now (for the UI and tests): requests running and queued, and so on."""
        return {"running": len(self._active), "queued": len(self._waiting), "max_batch": self.max_batch,
                "cache_rows": len(self._rows), "decode_steps": self.steps, "prefilled_tokens": self.prefilled_tokens,
                "reused_tokens": self.reused_tokens}

    def close(self) -> None:
        """Stop the engine thread (queued and running requests end "cancelled") and let go of the model,
        its cache and its graphs, so an unloaded tool's memory is freed."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._graphs.clear()
            self.model = self.cache = self.rope = self.seen = self._pending = None

    # ---- the engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        if self._stream is not None:
            torch.cuda.set_stream(self._stream)  # the current stream is per thread: this one's only
            self._stream.wait_stream(torch.cuda.default_stream(self.device))  # the cache's zeros are made
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._closed and not self._waiting and not self._active:
                        self._wake.wait()
                    if self._closed:
                        break
                    room = self.max_batch - len(self._active)
                    joining, self._waiting = self._waiting[:room], self._waiting[room:]
                if joining or any(r.stream.cancelled for r in self._active):
                    self._guarded(list(self._active), self._drain)  # the batch changes: settle the step in flight
                    for request in joining:
                        self._guarded([request], self._admit, request)
                    self._leave_cancelled()
                if self._active:
                    self._guarded(list(self._active), self._decode_step)
                else:
                    self._guarded([], self._drain)
            self._pending = None
            for request in self._active + self._waiting:
                self._finish(request, "cancelled")

    def _guarded(self, requests: list[_Request], fn, *args) -> None:
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

    def _admit(self, request: _Request) -> None:
        """Prefill a new request in a row (reusing the longest cached prefix of its tokens) and emit its first token."""
        if request.stream.cancelled:
            self._finish(request, request.stream.reason)
            return
        prompt, sig = request.prompt, request.prompt.signature()
        request.table = self.rope.table_for(len(prompt))
        row_index, reused = self._claim_row(request, sig)
        row = self._rows[row_index]
        request.row = row_index
        self._active.append(request)
        reused = min(reused, len(sig) - 1)  # the last token must run for its logits
        row.session, row.held, row.table = request.session, sig[:reused], request.table
        self.prefilled_tokens += len(sig) - reused
        self.reused_tokens += reused
        logits = self._prefill(prompt, row_index, reused, request.table)
        row.held = sig
        request.position = row.written = len(sig)
        request.stream.stats.cached_tokens = reused
        self.seen[row_index] = False
        if not prompt.slots:  # as transformers does: the prompt's own ids count for the penalty
            self.seen[row_index, torch.tensor(prompt.ids, device=self.device)] = True
        drawn = self._draw([request], logits[None], row_index)
        self._deliver(request, drawn.tolist()[0], logits)

    def _prefill(self, prompt: Prompt, row: int, start: int, table: int) -> Tensor:
        ids = torch.tensor([prompt.ids[start:]], dtype=torch.long, device=self.device)
        embeds = None
        if prompt.slots:
            if self._stream is not None:  # the embeddings were made on another thread's stream
                self._stream.wait_stream(torch.cuda.default_stream(self.device))
                for values in prompt.embeds:
                    values.record_stream(self._stream)
            embeds = self.model.embed(ids)
            for (slot, length), values in zip(prompt.slots, prompt.embeds):
                lo, hi = max(slot, start), slot + length
                if lo < hi:
                    embeds[0, lo - start:hi - start] = values[lo - slot:].to(embeds.device, embeds.dtype)
        with sdpa_kernel(PREFILL_ATTENTION):
            out = self.model(self.cache, self.rope, Prefill(row, start, table), tokens=ids, embeds=embeds)
        return out[0, -1, :self.vocab_size]

    def _decode_step(self) -> None:
        """Launch a decode step for every running request, then read the previous step's tokens
        while the GPU works on this one. While the batch stays the same, a step's inputs (the tokens
        just drawn, positions one further) are made on the GPU, so the host never stalls it."""
        active = list(self._active)
        n = len(active)
        bucket = _pow2_at_least(n)
        chained = self._pending is not None and self._pending.requests == active
        if chained:
            self._packed[0, :n].copy_(self._pending.drawn)
            self._packed[1, :n] += 1
        else:
            pad = bucket - n
            host = self._step_host.numpy()
            host[0, :bucket] = [r.last_token for r in active] + [0] * pad
            host[1, :bucket] = [r.position for r in active] + [self.scratch] * pad
            host[2, :bucket] = [r.table for r in active] + [0] * pad
            self._packed[:, :bucket].copy_(self._step_host[:, :bucket], non_blocking=True)
        kv_len = min(-(-(max(r.position for r in active) + 1) // GRAPH_BUCKET) * GRAPH_BUCKET, self.scratch + 1)
        logits = self._decode(bucket, kv_len, self._packed[:, :bucket])[:n, :self.vocab_size]
        self.steps += 1
        for r in active:
            r.position += 1
            self._rows[r.row].written = r.position
        drawn = self._draw(active, logits, 0)
        kept = logits.clone() if any(r.stream.logits is not None for r in active) else None  # graphs reuse theirs
        launched = _Step(active, drawn, kept, self._tokens_to_host(drawn))
        previous, self._pending = self._pending, launched
        if previous is not None:
            self._read(previous)
        if self._active != active:  # some finished: settle this step before the batch changes
            self._drain()

    def _tokens_to_host(self, drawn: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        """Start copying the drawn tokens to the host; the event marks when they are there."""
        self._flip ^= 1
        host = self._drawn_host[self._flip, :len(drawn)]
        host.copy_(drawn, non_blocking=True)
        if self.device.type != "cuda":
            return host, None
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _drain(self) -> None:
        if self._pending is not None:
            step, self._pending = self._pending, None
            self._read(step)

    def _read(self, step: "_Step") -> None:
        """Hand out a finished step's tokens to the requests still running."""
        host, done = step.copied
        if done is not None:
            done.synchronize()
        rows = step.logits if step.logits is not None else [None] * len(step.requests)
        for r, token, row_logits in zip(step.requests, host.tolist(), rows):
            if r.row < 0:  # finished while this step ran
                continue
            if r.stream.cancelled:
                self._finish(r, r.stream.reason)
                continue
            self._rows[r.row].held.append(r.last_token)
            self._deliver(r, token, row_logits)

    def _decode(self, bucket: int, kv_len: int, packed: Tensor) -> Tensor:
        """Logits [bucket, vocab] for one decode step; `packed` [3, bucket] holds the tokens,
        positions and rotary tables of rows 0..bucket-1."""
        def step(inputs: Tensor) -> Tensor:
            return self.model(self.cache, self.rope, Decode(inputs[1], inputs[2], kv_len), tokens=inputs[0, :, None])[:, -1]

        if not self.use_cuda_graphs:
            return step(packed)
        key = (bucket, kv_len)
        if key not in self._graphs:
            self._graphs[key] = CapturedCall(step, packed, pool=self._pool)
        graph = self._graphs[key]
        graph.inputs[0].copy_(packed)
        return graph.replay()

    def _draw(self, requests: list[_Request], logits: Tensor, first_row: int) -> Tensor:
        """Each request's next token (on the device) from its logits row; the requests run in the
        consecutive cache rows from `first_row`."""
        n = len(requests)
        params = [r.params for r in requests]
        uniforms = [r.draws.next() for r in requests]  # drawn every step, so a request's stream never shifts
        columns = self._draw_dev[:, :n]
        if any(p.temperature or p.repetition_penalty != 1.0 for p in params):  # greedy alone reads none
            self._flip_columns ^= 1  # the other buffer's upload may still be queued behind the step in flight
            host = self._draw_host[self._flip_columns]
            host.numpy()[:, :n] = sampling_columns(params, uniforms, self.vocab_size)
            columns.copy_(host[:, :n], non_blocking=True)
        seen = self.seen[first_row:first_row + n]
        drawn = sample(logits, params, seen, columns)
        seen.scatter_(1, drawn[:, None], True)
        return drawn

    def _deliver(self, r: _Request, token: int, logits: Tensor | None) -> None:
        """Hand `token` to its request, or end the request (a stop id, its length, the context end)."""
        stats = r.stream.stats
        now = time.perf_counter()
        if r.stream.logits is not None:
            r.stream.logits.append(logits.float().cpu())
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
        elif len(self._rows[r.row].held) + 1 >= self.context:
            self._finish(r, "context")

    def _leave_cancelled(self) -> None:
        for r in [r for r in self._active if r.stream.cancelled]:
            self._finish(r, r.stream.reason)

    def _finish(self, request: _Request, reason: str) -> None:
        """End a request: its stream closes; its row, holding its tokens for whoever continues them, leaves
        the running block."""
        request.stream.end(reason)
        if request.row < 0 or request not in self._active:
            return
        last = len(self._active) - 1
        i = request.row
        if reason == "error":  # what the row holds is unknown
            self._rows[i] = _Row()
        self._rows[i].last_used = time.perf_counter()
        self._swap(i, last)
        moved = self._active[last]
        self._active[i], moved.row = moved, i
        self._active.pop()
        request.row = -1

    def _claim_row(self, request: _Request, sig: list) -> tuple[int, int]:
        """The row a joining request runs in, moved to just after the running ones, and how many of its
        first positions that row already holds. Rows are found by content: the idle row sharing the
        longest prefix with the prompt (the request's own session's row first among equals), else an
        empty row, else the least recently used idle row (evicted)."""
        first_idle = len(self._active)
        idle = range(first_idle, len(self._rows))

        def shared(i: int) -> int:
            row = self._rows[i]
            return common_prefix(row.held, sig) if row.table == request.table else 0

        held = {i: shared(i) for i in idle}
        best = max(idle, key=lambda i: (held[i], request.session is not None and self._rows[i].session == request.session))
        if held[best] == 0:
            empty = [i for i in idle if not self._rows[i].held]
            best = (empty or [min(idle, key=lambda i: self._rows[i].last_used)])[0]
            self._rows[best] = _Row()
        self._swap(best, first_idle)
        return first_idle, held[best]

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        self.cache.swap_rows(a, b, max(self._rows[a].written, self._rows[b].written))
        self.seen[[a, b]] = self.seen[[b, a]]
        self._rows[a], self._rows[b] = self._rows[b], self._rows[a]
