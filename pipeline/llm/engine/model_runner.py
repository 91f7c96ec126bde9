"""ModelRunner: runs the decoder for the engine: prompt chunks, and decode steps as CUDA graphs.

It owns the model, the rotary tables, the captured graphs and the pinned buffers that carry a step's
inputs up and its tokens down, so the engine thread's host work never waits for the GPU except where
it reads the drawn tokens (once per step, one step behind). It knows nothing of requests or rows'
contents: it is handed row numbers and positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.cuda_graphs import CapturedCall
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.engine.speculation import DRAFT_SIZES, MAX_DRAFT
from pipeline.llm.model import Chunk, Decode, Decoder, KVCache, Prefill, RotaryTables, Verify
from plugins.lowbit import rows_as_one_row

GRAPH_BUCKET = 256  # decode graphs are captured for context lengths rounded up to this
# Prefill attention without cuDNN's kernel: it plans once per shape (~60 ms on an H100), and every
# turn of a conversation is a new shape (bench/sdpa_first_call.py); flash / memory-efficient plan nothing.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CHUNK_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # a `Chunk` off FlashAttention has a mask
SCRATCH = MAX_DRAFT + 1  # positions past the context that padding rows write: a verify step's T at most
MAX_GRAPHED_CHUNK = 512  # longer prompt reads (a lone prompt, read whole) run eagerly: a graph per length would not pay


def pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


class ModelRunner:
    def __init__(self, model: Decoder, context: int, vocab_size: int, max_batch: int,
                 use_cuda_graphs: bool | None = None):
        """`context` positions per row, plus SCRATCH positions that padding rows of a bucketed step write
        (`positions` in all: the cache rows' length)."""
        self.model, self.vocab_size = model, vocab_size
        self.device = model.embed.weight.device
        self.scratch, self.positions = context, context + SCRATCH
        self.rope = RotaryTables(model.config, self.positions, self.device)
        self.use_cuda_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self._graphs: dict[tuple, CapturedCall] = {}
        self.captures = 0  # graphs captured so far: a step that captured one took far longer than its kind does
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        self._pinned = self.device.type == "cuda"
        self._packed = torch.zeros(3, max_batch, dtype=torch.long, device=self.device)  # tokens, positions, tables
        # Its own CUDA stream: a SAM click or an image encode on the default stream does not queue
        # behind decode steps already launched.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def enter_thread(self) -> None:
        """Make this runner's stream current on the calling thread (the engine's), after the cache's zeros."""
        if self._stream is not None:
            torch.cuda.set_stream(self._stream)  # the current stream is per thread: this one's only
            self._stream.wait_stream(torch.cuda.default_stream(self.device))

    def close(self) -> None:
        self._graphs.clear()
        self.model = self.rope = None

    def prefill(self, cache: KVCache, prompt: Prompt, row: int, start: int, end: int, table: int,
                logits: bool = True, graphed: bool = False) -> Tensor | None:
        """Write `prompt`'s positions start..end-1 into cache row `row` (a chunk of it, or all that a cached
        prefix leaves: an image slot may begin before `start` or end after `end`); the chunk's last
        position's logits where asked for (a prompt's last chunk), else None. The ids go up from pinned
        memory without waiting for the GPU: a chunk queues behind the decode step in flight. `graphed`:
        a chunk read while other requests decode, which must not keep them waiting on the host
        (`_chunk`)."""
        if graphed and end - start <= MAX_GRAPHED_CHUNK and start + pow2_at_least(end - start) <= self.scratch + 1 \
                and not any(slot < end and start < slot + length for slot, length in prompt.slots):
            return self._chunk(cache, prompt.ids[start:end], row, start, table, logits)
        ids = torch.tensor([prompt.ids[start:end]], dtype=torch.long, pin_memory=self._pinned)
        ids = ids.to(self.device, non_blocking=True)
        embeds = None
        if any(slot < end and start < slot + length for slot, length in prompt.slots):
            if self._stream is not None:  # the embeddings were made on another thread's stream
                self._stream.wait_stream(torch.cuda.default_stream(self.device))
                for values in prompt.embeds:
                    values.record_stream(self._stream)
            embeds = self.model.embed(ids)
            for (slot, length), values in zip(prompt.slots, prompt.embeds):
                lo, hi = max(slot, start), min(slot + length, end)
                if lo < hi:
                    embeds[0, lo - start:hi - start] = values[lo - slot:hi - slot].to(embeds.device, embeds.dtype)
        with sdpa_kernel(PREFILL_ATTENTION):
            out = self.model(cache, self.rope, Prefill(row, start, table), tokens=ids, embeds=embeds, logits=logits)
        return out[0, -1, :self.vocab_size] if logits else None

    def _chunk(self, cache: KVCache, ids: tuple[int, ...], row: int, start: int, table: int,
               logits: bool) -> Tensor | None:
        """A prompt chunk (no image slot) as a `Chunk` step: its ids padded to a power of two, with row,
        start, table and last real position in one tensor, its keys read up to a power of two, so on a
        GPU one captured graph per (length, key length, logits) replays it. The padding's cache entries
        lie past the prompt, where nothing reads before a decode step writes them. Launched eagerly, a
        chunk costs 13–25 ms of host time on an H100 machine, more than the GPU takes for it
        (bench/chunked_prefill.py): the running chats' next token would wait for the host."""
        n, size = len(ids), pow2_at_least(len(ids))
        host = torch.tensor([*ids, *[0] * (size - n), row, start, table, n - 1], dtype=torch.long,
                            pin_memory=self._pinned)
        packed = host.to(self.device, non_blocking=True)
        kv_len = min(pow2_at_least(start + size), self.scratch + 1)

        def step(inputs: Tensor) -> Tensor | None:
            chunk = Chunk(inputs[size:size + 1], inputs[size + 1:size + 2], inputs[size + 2:size + 3], kv_len)
            with sdpa_kernel(CHUNK_ATTENTION):
                return self.model(cache, self.rope, chunk, tokens=inputs[None, :size], logits=logits,
                                  last=inputs[size + 3:size + 4])

        out = self._run(("chunk", size, kv_len, logits), step, packed)
        return out[0, -1, :self.vocab_size].clone() if logits else None  # the graph's buffer is reused

    def decode(self, cache: KVCache, n: int, rows: tuple[list[int], list[int], list[int]] | None,
               chained: Tensor | None, kv_len: int) -> Tensor:
        """Logits [n, vocab] for one decode step of rows 0..n-1. Their inputs are `rows` (tokens,
        positions, rotary tables) when the batch changed, else `chained`: the tokens the previous
        step drew, each row one position further, made on the GPU so the host never stalls it."""
        bucket = pow2_at_least(n)
        if rows is None:
            self._packed[0, :n].copy_(chained)
            self._packed[1, :n] += 1
        else:
            pad = bucket - n
            # Fresh pinned memory each time (torch's host allocator reuses a block only once its copy has
            # run): one buffer kept for every step was rewritten while an earlier step's copy still
            # waited in the stream, and that step ran on the next one's tokens and positions.
            host = torch.tensor([list(values) + [fill] * pad for values, fill in zip(rows, (0, self.scratch, 0))],
                                dtype=torch.long, pin_memory=self._pinned)
            self._packed[:, :bucket].copy_(host, non_blocking=True)
        kv_len = min(-(-kv_len // GRAPH_BUCKET) * GRAPH_BUCKET, self.scratch + 1)
        packed = self._packed[:, :bucket]

        def step(inputs: Tensor) -> Tensor:
            return self.model(cache, self.rope, Decode(inputs[1], inputs[2], kv_len), tokens=inputs[0, :, None])[:, -1]

        return self._run(("decode", bucket, kv_len), step, packed)[:n, :self.vocab_size]

    def verify(self, cache: KVCache, tokens: list[list[int]], starts: list[int], tables: list[int]) -> Tensor:
        """Logits [n, T, vocab] for a verify step of rows 0..n-1: row i's `tokens[i]` (its last token and the
        drafted ones after it, padded to T) at positions starts[i]..starts[i]+T-1. The rows are padded to a
        power of two with rows that write the scratch positions; on a GPU one captured graph per
        (rows, T, key length) replays it. The host waits for nothing here: the ids go up from pinned memory."""
        n, need = len(tokens), len(tokens[0])
        bucket = pow2_at_least(n)
        pad = bucket - n

        def kv_len_for(size: int) -> int:
            return min(-(-(max(starts) + size) // GRAPH_BUCKET) * GRAPH_BUCKET, self.positions)

        # A larger draft size whose graph exists beats capturing one (eager runs and a capture: tens of ms,
        # more than its padding costs); the padding positions repeat each row's last token and are rewritten later.
        size = next((k + 1 for k in DRAFT_SIZES if k + 1 >= need
                     and ("verify", bucket, k + 1, kv_len_for(k + 1)) in self._graphs), need)
        rows = [[*t, *t[-1:] * (size - need), start, table] for t, start, table in zip(tokens, starts, tables)]
        host = torch.tensor(rows + [[0] * size + [self.scratch, 0]] * pad, dtype=torch.long, pin_memory=self._pinned)
        packed = host.to(self.device, non_blocking=True)
        kv_len = kv_len_for(size)

        def step(inputs: Tensor) -> Tensor:
            with rows_as_one_row(bucket == 1):  # one chat's positions: low-bit layers round as its decode steps do
                return self.model(cache, self.rope, Verify(inputs[:, size], inputs[:, size + 1], kv_len),
                                  tokens=inputs[:, :size], last_only=False)

        return self._run(("verify", bucket, size, kv_len), step, packed)[:n, :need, :self.vocab_size]

    def warm_verify(self, cache: KVCache) -> None:
        """Compile the verify step's kernels for every draft size before a reply needs them (a first
        launch's Triton compiles take seconds): one step each, in the scratch positions, which hold nothing."""
        with torch.inference_mode():
            for k in DRAFT_SIZES:
                self.verify(cache, [[0] * (k + 1)], [self.scratch], [0])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run(self, key: tuple, step: Callable[[Tensor], Tensor | None], packed: Tensor) -> Tensor | None:
        """`step(packed)`: eagerly, or on a GPU by replaying the graph captured for `key` (at its first use)
        with `packed` copied into its input; its output is the graph's own buffer, reused by the next replay."""
        if not self.use_cuda_graphs:
            return step(packed)
        if key not in self._graphs:
            self._graphs[key] = CapturedCall(step, packed, pool=self._pool)
            self.captures += 1
        graph = self._graphs[key]
        graph.inputs[0].copy_(packed)
        return graph.replay()

    def to_host(self, values: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        """Start copying `values` to the host, into page-locked memory of their own (an earlier copy not yet
        read is never overwritten); the event marks when they are there."""
        host = values.to("cpu", non_blocking=True)
        if self.device.type != "cuda":
            return host, None
        done = torch.cuda.Event()
        done.record()
        return host, done
