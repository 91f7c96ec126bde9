"""ModelRunner: runs the decoder for the engine, one forward per engine step, replayed as CUDA graphs.

A step is what the scheduler planned: the running rows' tokens (one each for a decode, the last token and
its drafts for a verify: a decode is a verify without drafts) and the prompt chunks read beside them, all in
one forward (`Decoder.forward`: the GEMMs once over every token, the attention part by part), so a chunk
costs the running chats little more than the weights they read anyway. The runner owns the model, the
rotary tables, the captured graphs, the split-K scratch of its steps and the pinned buffers that carry a
step's inputs up and its tokens down, so the engine thread's host work never waits for the GPU except
where it reads the drawn tokens. It knows nothing of requests or rows' contents: it is handed row numbers,
positions and token ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.cuda_graphs import CapturedCall
from pipeline.llm.engine.speculation import DRAFT_SIZES, MAX_DRAFT, VerifyCost
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Chunk, Part, Prefill, Rows
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.text.prompt import Prompt
from plugins import decode_attention, lowbit
from plugins.cuda_streams import own_stream, release

GRAPH_BUCKET = 256  # the rows' key count is rounded up to this for their graphs
# Prefill attention without cuDNN's kernel: it plans once per shape (~60 ms on an H100), and every
# turn of a conversation is a new shape (bench/sdpa_first_call.py); flash / memory-efficient plan nothing.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SCRATCH = MAX_DRAFT + 1  # positions past the context that padding rows write: a verify step's T at most
MAX_GRAPHED_CHUNK = 512  # longer prompt reads (a lone prompt, read whole) run eagerly: a graph per length would not pay


def pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class ChunkRead:
    """A prompt chunk of a step: `prompt`'s positions start..end-1 into cache row `row`, rotary offset
    `offset` (an image slot may begin before `start` or end after `end`); `logits`: its last position's are
    wanted (the prompt's last chunk, whose first token is drawn in the same step)."""

    prompt: Prompt
    row: int
    start: int
    end: int
    offset: int
    logits: bool

    def has_slots(self) -> bool:
        return any(slot < self.end and self.start < slot + length for slot, length in self.prompt.slots)

    def rope(self) -> Tensor | None:
        """Its tokens' own M-RoPE positions [3, size] where it holds a picture's (Qwen2.5-VL); else None."""
        return self.prompt.rope[:, self.start:self.end] if self.prompt.rope is not None and self.has_slots() else None


@dataclasses.dataclass(frozen=True)
class RowsFeed:
    """What rows 0..n-1 feed in a step: `tokens[i]` (one token, or the last one and its drafts) at positions
    starts[i].. with rotary offsets[i]; or, `chained`, the tokens the previous step drew (on the device),
    each row one position further, so the host never stalls the GPU for them."""

    n: int
    tokens: list[list[int]] | None = None
    starts: list[int] | None = None
    offsets: list[int] | None = None
    chained: Tensor | None = None
    kv_need: int = 0  # the most positions a row reads in this step (its last position + 1)


class ModelRunner:
    def __init__(self, model: Decoder, context: int, vocab_size: int, max_batch: int,
                 use_cuda_graphs: bool | None = None, exact_verify: bool = True):
        """`context` positions per row, plus SCRATCH positions that padding rows of a bucketed step write
        (`positions` in all: the cache rows' length). `exact_verify`: one chat's verify step runs its
        positions as one-row launches, rounding as its decode steps do (low-bit weights; greedy replies the
        same as without speculation); else the batch kernels, faster, whose rounding may part a reply from
        the plain one where two tokens are nearly tied."""
        self.model, self.vocab_size, self.exact_verify = model, vocab_size, exact_verify
        self.device = model.norm.weight.device
        self.scratch, self.positions = context, context + SCRATCH
        self.rope = RotaryTables(model.config, self.positions, self.device)
        self.use_cuda_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self._graphs: dict[tuple, CapturedCall] = {}
        self.captures = 0  # graphs captured so far
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        self._pinned = self.device.type == "cuda"
        self._state = torch.zeros(max_batch, 3, dtype=torch.long, device=self.device)  # rows' token, position, rotary offset
        self._ahead: torch.cuda.Event | None = None  # marks the step launched last
        # The split-K partials and counters of this runner's steps, its own: two engines over one model (a
        # benchmark's plain and speculating ones), or a step and a warm-up on two streams, never share them.
        self._lowbit_scratch = lowbit.Workspace(self.device)
        self._attention_scratch: dict = {}
        # Its own CUDA stream (one no other engine or capture holds): a SAM click or an image encode on the
        # default stream does not queue behind decode steps already launched.
        self._stream = own_stream(self.device) if self.device.type == "cuda" else None

    def enter_thread(self) -> None:
        """Make this runner's stream current on the calling thread (the engine's), after the cache's zeros; and
        give that thread's torch ops the threads the model asks for (`torch_threads`, a model that runs its own)."""
        if (wanted := getattr(self.model, "torch_threads", None)) is not None:
            torch.set_num_threads(wanted)  # this thread's own setting (OpenMP's is per thread)
        if self._stream is not None:
            torch.cuda.set_stream(self._stream)  # the current stream is per thread: this one's only
            self._stream.wait_stream(torch.cuda.default_stream(self.device))

    def close(self) -> None:
        self._graphs.clear()
        self.model = self.rope = None
        if self._stream is not None:
            release(self._stream)

    def graphable(self, chunk: ChunkRead) -> bool:
        """A chunk that a captured graph can read: short, no image slot, its padding inside the row."""
        size = chunk.end - chunk.start
        return size <= MAX_GRAPHED_CHUNK and chunk.start + pow2_at_least(size) <= self.scratch + 1 \
            and not chunk.has_slots()

    def step(self, cache: KVCache, rows: RowsFeed | None, chunks: list[ChunkRead] = (),
             graphed: bool = True) -> tuple[Tensor | None, list[Tensor]]:
        """One engine step: the rows' logits [n, T, vocab] (None without rows) and the logits [vocab] of each
        chunk that asks for them. On a GPU, where `graphed` and every chunk is `graphable`, one captured graph
        per (rows bucket, T, key length, chunk shapes) replays it; the ids go up from pinned memory without
        waiting for the GPU. Else it runs eagerly, chunks as `Prefill`s (a lone prompt read whole, an image's)."""
        graphed = graphed and self.use_cuda_graphs and all(map(self.graphable, chunks))
        rows_in, shape = self._rows_input(rows) if rows is not None else (None, (0, 0, 0, 0))
        bucket, per_row, need, kv_len = shape
        specs = tuple(self._chunk_shape(c, graphed) for c in chunks)
        begins = list(itertools.accumulate((size for size, _, _ in specs), initial=0))  # each chunk's ids in chunk_in
        ids = [[*c.prompt.ids[c.start:c.end], *[0] * (size - c.end + c.start)] for c, (size, _, _) in zip(chunks, specs)]
        meta = [[c.row, c.start, c.offset, c.end - c.start - 1] for c in chunks] if graphed else []
        chunk_in = None
        if chunks:
            host = torch.tensor([v for part in ids + meta for v in part], dtype=torch.long, pin_memory=self._pinned)
            chunk_in = host.to(self.device, non_blocking=True)
        embeds = self._embeds(chunks, rows_in, per_row, chunk_in) if any(c.has_slots() for c in chunks) else None

        def forward(rows_in: Tensor | None, chunk_in: Tensor | None) -> Tensor | None:
            parts: list[Part] = []
            tokens, outputs = [], []
            if rows_in is not None:
                tokens.append(rows_in[:, :per_row].flatten())
                parts.append(Rows(rows_in[:, per_row], rows_in[:, per_row + 1], kv_len, per_row))
                outputs.append(torch.arange(bucket * per_row, device=self.device))
            offset, at = bucket * per_row, begins[-1]  # the chunks' row, start, offset, last come after their ids
            for i, (c, (size, chunk_kv, logits)) in enumerate(zip(chunks, specs)):
                tokens.append(chunk_in[begins[i]:begins[i + 1]])
                if graphed:
                    m = chunk_in[at + 4 * i:at + 4 * i + 4]
                    parts.append(Chunk(m[0:1], m[1:2], m[2:3], chunk_kv, size))
                    last = offset + m[3:4]
                else:
                    parts.append(Prefill(c.row, c.start, c.offset, size, c.rope()))
                    last = torch.arange(offset + size - 1, offset + size, device=self.device)
                if logits:
                    outputs.append(last)
                offset += size
            wanted = torch.cat(outputs) if outputs else None
            with sdpa_kernel(PREFILL_ATTENTION), self.scratch_of_this_runner(), \
                    lowbit.rows_as_one_row(bucket == 1 and not chunks and (per_row == 1 or self.exact_verify)):
                return self.model(cache, self.rope, tuple(parts), tokens=torch.cat(tokens)[None] if embeds is None
                                  else None, embeds=embeds, outputs=wanted)

        key = ("step", bucket, per_row, kv_len, specs)
        out = self._run(key, forward, rows_in, chunk_in) if graphed else forward(rows_in, chunk_in)
        if out is None:
            return None, []
        out = out[0, :, :self.vocab_size]
        rows_logits = out[:bucket * per_row].view(bucket, per_row, -1)[:rows.n, :need] if rows is not None else None
        return rows_logits, list(out[bucket * per_row:])

    def _chunk_shape(self, chunk: ChunkRead, graphed: bool) -> tuple[int, int, bool]:
        """(tokens it feeds, key length it reads, its logits wanted): graphed, its ids are padded to a power
        of two and its keys read up to one, so that a graph serves many chunks; eagerly, as they are."""
        if not graphed:
            return chunk.end - chunk.start, 0, chunk.logits
        size = pow2_at_least(chunk.end - chunk.start)
        return size, min(pow2_at_least(chunk.start + size), self.scratch + 1), chunk.logits

    def _rows_input(self, rows: RowsFeed) -> tuple[Tensor, tuple[int, int, int, int]]:
        """The rows' inputs on the device [bucket, T + 2] (tokens, start, rotary offset; padding rows write the
        scratch positions), and (bucket, T, the T asked for, key length). A verify step takes a longer
        draft size whose graph exists rather than capture one (eager runs and a capture cost tens of ms,
        more than the padding: the extra positions repeat the row's last token and are written again later)."""
        n, bucket = rows.n, pow2_at_least(rows.n)
        need = 1 if rows.tokens is None else len(rows.tokens[0])

        def kv_len_for(size: int) -> int:  # padding rows write (and read) scratch positions up to scratch + size - 1
            return min(-(-(rows.kv_need + size - need) // GRAPH_BUCKET) * GRAPH_BUCKET, self.scratch + size)

        if need == 1:
            if rows.chained is not None:
                self._state[:n, 0].copy_(rows.chained)
                self._state[:n, 1] += 1
            else:
                # Fresh pinned memory each time (torch's host allocator reuses a block only once its copy has
                # run): one buffer kept for every step was rewritten while an earlier step's copy still
                # waited in the stream, and that step ran on the next one's tokens and positions.
                host = torch.tensor([[t[0], s, o] for t, s, o in zip(rows.tokens, rows.starts, rows.offsets)]
                                    + [[0, self.scratch, 0]] * (bucket - n), dtype=torch.long, pin_memory=self._pinned)
                self._state[:bucket].copy_(host, non_blocking=True)
            return self._state[:bucket], (bucket, 1, 1, kv_len_for(1))
        size = next((k + 1 for k in DRAFT_SIZES if k + 1 >= need and any(
            key[:4] == ("step", bucket, k + 1, kv_len_for(k + 1)) for key in self._graphs)), need)
        host = torch.tensor([[*t, *t[-1:] * (size - need), s, o] for t, s, o in zip(rows.tokens, rows.starts, rows.offsets)]
                            + [[0] * size + [self.scratch, 0]] * (bucket - n), dtype=torch.long, pin_memory=self._pinned)
        return host.to(self.device, non_blocking=True), (bucket, size, need, kv_len_for(size))

    def _embeds(self, chunks: list[ChunkRead], rows_in: Tensor | None, per_row: int, chunk_in: Tensor) -> Tensor:
        """The step's input embeddings where a chunk holds an image's slots: the ids' embeddings with the
        slots' positions replaced by the image's (made on another thread's stream)."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.default_stream(self.device))
            for c in chunks:
                for values in c.prompt.embeds:
                    values.record_stream(self._stream)
        ids = [chunk_in] if rows_in is None else [rows_in[:, :per_row].flatten(), chunk_in]
        embeds = self.model.embed(torch.cat(ids)[None])
        offset = 0 if rows_in is None else rows_in.shape[0] * per_row
        for c in chunks:
            for (slot, length), values in zip(c.prompt.slots, c.prompt.embeds):
                lo, hi = max(slot, c.start), min(slot + length, c.end)
                if lo < hi:
                    embeds[0, offset + lo - c.start:offset + hi - c.start] = \
                        values[lo - slot:hi - slot].to(embeds.device, embeds.dtype)
            offset += c.end - c.start
        return embeds

    @contextlib.contextmanager
    def scratch_of_this_runner(self):
        """The low-bit kernels' split-K scratch and the decode attention's partials: this runner's own."""
        with lowbit.using_workspace(self._lowbit_scratch), decode_attention.using_workspaces(self._attention_scratch):
            yield

    def verify_cost(self, cache: KVCache, rows: int = 1, repeats: int = 20, timed: bool = True) -> VerifyCost | None:
        """What a step of `rows` rows checking k drafted tokens each costs in one-token steps of those rows
        for this model on this GPU, measured once (every draft size's step compiled and captured on the
        way, before a reply needs it): steps replayed in the scratch positions, which hold nothing; host work
        included (a small model on a fast GPU is bound by it, not by its weights). Fixed from then on, so
        which steps verify follows from the tokens alone, never from the clock between steps. Fitted as
        `VerifyCost`, whose fixed part also holds the wait a verify step costs the host: its tokens are settled
        before the next step is launched, where plain steps run one ahead of the host (speculation measured
        slower than none with 8 chats and on int4's open chat while this wait was left out, H200 2026-11-28).
        `timed` False: the steps compiled and captured only (their costs were recorded by an earlier launch)."""
        def seconds(k: int, settled: bool = False) -> float:
            feed = RowsFeed(rows, [[0] * (k + 1)] * rows, [self.scratch] * rows, [0] * rows,
                            kv_need=self.scratch + k + 1)
            for _ in range(3):  # the capture, and a replay
                self.step(cache, feed)
            if not timed:
                return 1.0
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            for _ in range(repeats):
                logits, _ = self.step(cache, feed)
                if settled:  # as a verify step is: its tokens read before the next launch
                    logits[:, 0, :1].cpu()
            torch.cuda.synchronize(self.device)
            return (time.perf_counter() - start) / repeats

        plain = seconds(0)
        extra = [(k, seconds(k) / plain - 1.0) for k in DRAFT_SIZES]  # each draft size's step captured on the way
        if not timed:
            return None
        wait = max(seconds(0, settled=True) / plain - 1.0, 0.0)
        mean_k, mean_e = sum(k for k, _ in extra) / len(extra), sum(e for _, e in extra) / len(extra)
        slope = sum((k - mean_k) * (e - mean_e) for k, e in extra) / sum((k - mean_k) ** 2 for k, _ in extra)
        slope = max(slope, 0.0)
        return VerifyCost(max(mean_e - slope * mean_k, 0.0) + wait, slope)

    def _run(self, key: tuple, forward: Callable[..., Tensor | None], *inputs: Tensor | None) -> Tensor | None:
        """`forward(*inputs)` by replaying the graph captured for `key` (at its first use) with `inputs`
        copied into its own; its output is the graph's own buffer, reused by the next replay."""
        if key not in self._graphs:
            try:
                self._graphs[key] = CapturedCall(forward, *inputs, pool=self._pool)
            except Exception:
                # torch leaves a pool whose capture failed marked as recording: later captures into it would
                # all fail ("already recording to mempool_id"), so the next ones take a new pool
                self._pool = torch.cuda.graph_pool_handle()
                raise
            self.captures += 1
        graph = self._graphs[key]
        for buffer, value in zip(graph.inputs, inputs):
            if buffer is not None:
                buffer.copy_(value)
        return graph.replay()

    def one_step_ahead(self) -> None:
        """Mark the step just launched and wait until the one before it has run: the host stays at most one
        step ahead of the GPU (steps of prompt chunks alone read nothing back, so nothing else holds it), so a
        prompt that joins rides in the next step instead of queueing behind several already launched."""
        if self.device.type != "cuda":
            return
        launched = torch.cuda.Event()
        launched.record()
        if self._ahead is not None:
            self._ahead.synchronize()
        self._ahead = launched

    def to_host(self, values: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        """Start copying `values` to the host, into page-locked memory of their own (an earlier copy not yet
        read is never overwritten); the event marks when they are there."""
        host = values.to("cpu", non_blocking=True)
        if self.device.type != "cuda":
            return host, None
        done = torch.cuda.Event()
        done.record()
        return host, done
