"""ModelRunner: runs the decoder for the engine, one forward per engine step, replayed as CUDA graphs.

A step is what the scheduler planned: the running rows' tokens (one each for a decode, the last token and
the tokens proposed after it for a verify: a decode is a verify of none) and the prompt chunks read beside them, all in
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
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.cuda_graphs import CapturedCall
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Part, Prefill, Rows, Tokens
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.text.prompt import Prompt
from plugins import decode_attention, lowbit
from plugins.workspaces import using_workspaces
from plugins.cuda_streams import own_stream, release

GRAPH_BUCKET = 256  # eagerly (the CPU), the rows' keys are read up to a multiple of this past the longest row's
# Prefill attention without cuDNN's kernel: it plans once per shape (~60 ms on an H100), and every
# turn of a conversation is a new shape (bench/sdpa_first_call.py); flash / memory-efficient plan nothing.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
MAX_GRAPHED_TOKENS = 512  # steps with more prompt tokens (a lone prompt's) run eagerly: the launches are a small share


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
    """What rows 0..n-1 feed in a step: `tokens[i]` (one token, or the last one and those after it) at positions
    starts[i].. with rotary offsets[i]; or, `chained`, after the step before (on the device: each row's last kept
    token, and how many it kept, which moves its positions), each row's first token that step's last kept one
    and its positions past what that step kept (the tokens after the first, where any, from `tokens`), so
    the host never stalls the GPU for them."""

    n: int
    tokens: list[list[int]] | None = None
    starts: list[int] | None = None
    offsets: list[int] | None = None
    chained: tuple[Tensor, Tensor] | None = None
    kv_need: int = 0  # the most positions a row reads in this step (its last position + 1)


class ModelRunner:
    def __init__(self, model: Decoder, context: int, vocab_size: int, max_batch: int,
                 use_cuda_graphs: bool | None = None, widths: Sequence[int] = (1,), wide_rows: int = 1,
                 exact_rows: bool = True, step_tokens: int | None = None):
        """`widths`: how many tokens a row may feed in a step (1, and more where the engine verifies tokens:
        it pads to one of these), by at most `wide_rows` rows (a power of two) where more than one; `context`
        positions per row, plus as many positions past it as the widest (`positions` in all: the cache rows'
        length) that padding rows of a bucketed step write. `exact_rows`:
        one row feeding several tokens runs them as one-row launches, rounding as its one-token steps do
        (low-bit weights: greedy replies the same with verify steps as without); else the batch kernels, faster,
        whose rounding may part a reply from the plain one where two tokens are nearly tied. `step_tokens`: the
        scheduler's budget of a step's tokens while rows run (None: none), which bounds the prompt tokens a
        graphed step lays out, so the graph table holds no larger step."""
        self.model, self.vocab_size, self.exact_rows, self.max_batch = model, vocab_size, exact_rows, max_batch
        self.widths, self.wide_rows = tuple(sorted(set(widths) | {1})), wide_rows
        self.tile = decode_attention.tile_queries(model.config.num_heads, model.config.num_kv_heads)
        # each chunk but the last (one per other row at most) ends its run of `tile` tokens: up to tile - 1 of padding
        laid_out = step_tokens + max(max_batch - 2, 0) * (self.tile - 1) if step_tokens else MAX_GRAPHED_TOKENS
        self.graphed_tokens = self._text_size(min(laid_out, MAX_GRAPHED_TOKENS - max_batch))
        self.device = model.norm.weight.device
        self.scratch, self.positions = context, context + self.widths[-1]
        self.rope = RotaryTables(model.config, self.positions, self.device)
        self.use_cuda_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self._graphs: dict[tuple, CapturedCall] = {}
        self.captures = self.missed = 0  # graphs captured so far; steps run eagerly for want of one, once ready
        self.ready = False  # the graph table is captured: no capture from now on
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        self._pinned = self.device.type == "cuda"
        self._state = torch.zeros(max_batch, 4, dtype=torch.long, device=self.device)  # rows' first token, position, rotary offset, live
        self._padding = torch.tensor([[0, self.scratch, 0, 0]] * max_batch, device=self.device)  # a padding row's
        self._ahead: torch.cuda.Event | None = None  # marks the step launched last
        # The split-K partials and counters of this runner's steps, its own: two engines over one model (a
        # benchmark's two engines), or a step and a warm-up on two streams, never share them.
        self._lowbit_scratch = lowbit.Workspace(self.device)
        self._partials_scratch: dict = {}
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

    def step(self, cache: KVCache, rows: RowsFeed | None, chunks: list[ChunkRead] = (),
             graphed: bool = True) -> tuple[Tensor | None, list[Tensor]]:
        """One engine step: the rows' logits [n, T, vocab] (None without rows) and the logits [vocab] of each
        chunk that asks for them. On a GPU every prompt's text is read the same way, as `Tokens` (one attention
        path, whatever else runs), and where `graphed` and no chunk holds a picture a graph keyed by the padded
        rows, tokens per row and prompt tokens alone replays it (`table_keys`: all captured as the engine
        starts); the ids go up from pinned memory without waiting for the GPU. Else it runs eagerly (a lone
        prompt, a picture's chunk: a `Prefill`, as every chunk is on the CPU)."""
        on_gpu = self.device.type == "cuda" or self.use_cuda_graphs
        text = [c for c in chunks if not c.has_slots()] if on_gpu else []
        prefills = [c for c in chunks if c not in text]
        layout = self._layout(text)
        graphed = graphed and self.use_cuda_graphs and not prefills and \
            len(layout[0]) <= MAX_GRAPHED_TOKENS - self.max_batch
        tile_rows = decode_attention.TILE_ROWS
        if graphed and text:
            size = self._text_size(len(self._layout(text, tail=False)[0]))
            layout = self._layout(text, size, self.max_batch, tail=False)
        elif text:  # eagerly (a prompt read with nothing running, and what joins it): the tile its longest chunk takes
            longest = max(text, key=lambda c: c.end - c.start)
            tile_rows = decode_attention.prompt_tile_rows(longest.end - longest.start, longest.start)
            if tile_rows != decode_attention.TILE_ROWS and len(text) > 1:  # runs as long as that tile's queries
                c = self.model.config
                layout = self._layout(text, run=decode_attention.tile_queries(c.num_heads, c.num_kv_heads, tile_rows))
        ids, places, lasts = layout
        # a graphed step that reads prompt text runs its rows in the largest bucket: one graph per prompt size
        # (the padding rows read nothing, and cost a few GEMM rows beside the prompt's)
        rows_in, (bucket, per_row, need, kv_len) = \
            self._rows_input(rows, on_gpu, self.max_batch if graphed and text else pow2_at_least(rows.n)) \
            if rows is not None else (None, (0, 0, 0, 0))
        host = [*ids, *places, *lasts, *(v for c in prefills for v in c.prompt.ids[c.start:c.end])]
        chunk_in = None
        if host:
            chunk_in = torch.tensor(host, dtype=torch.long, pin_memory=self._pinned).to(self.device, non_blocking=True)
        size = len(ids)

        def forward(rows_in: Tensor | None, chunk_in: Tensor | None) -> Tensor | None:
            parts: list[Part] = []
            tokens, outputs = [], []
            if rows_in is not None:
                tokens.append(rows_in[:, :per_row].flatten())
                parts.append(Rows(rows_in[:, per_row], rows_in[:, per_row + 1], kv_len, per_row, rows_in[:, per_row + 2]))
                outputs.append(torch.arange(bucket * per_row, device=self.device))
            offset = bucket * per_row
            if size:
                ids_in, places_in = chunk_in[:size], chunk_in[size:5 * size].view(4, size)
                tokens.append(ids_in)
                parts.append(Tokens(*places_in, kv_len=self.positions, tile_rows=tile_rows))
                if lasts:
                    outputs.append(offset + chunk_in[5 * size:5 * size + len(lasts)])
                offset += size
            at = 5 * size + len(lasts)
            for c in prefills:
                n = c.end - c.start
                tokens.append(chunk_in[at:at + n])
                parts.append(Prefill(c.row, c.start, c.offset, n, c.rope()))
                if c.logits:
                    outputs.append(torch.arange(offset + n - 1, offset + n, device=self.device))
                offset, at = offset + n, at + n
            wanted = torch.cat(outputs) if outputs else None
            embeds = self._embeds(prefills, torch.cat(tokens), offset - sum(c.end - c.start for c in prefills)) \
                if any(c.has_slots() for c in prefills) else None
            with sdpa_kernel(PREFILL_ATTENTION), self.scratch_of_this_runner(), \
                    lowbit.rows_as_one_row(bucket == 1 and not chunks and (per_row == 1 or self.exact_rows)):
                return self.model(cache, self.rope, tuple(parts), tokens=torch.cat(tokens)[None] if embeds is None
                                  else None, embeds=embeds, outputs=wanted)

        key = ("step", bucket, per_row, size)
        out = self._run(key, forward, rows_in, chunk_in) if graphed else forward(rows_in, chunk_in)
        if out is None:
            return None, []
        out = out[0, :, :self.vocab_size]
        rows_logits = out[:bucket * per_row].view(bucket, per_row, -1)[:rows.n, :need] if rows is not None else None
        # the forward's order: the text chunks' last tokens (padded to `lasts` in a graph), then the prefills'
        at = bucket * per_row + len(lasts)
        firsts = dict(zip(map(id, [c for c in text if c.logits] + [c for c in prefills if c.logits]),
                          [*out[bucket * per_row:bucket * per_row + len(lasts)], *out[at:]]))
        return rows_logits, [firsts[id(c)] for c in chunks if c.logits]

    def _text_size(self, laid: int) -> int:
        """The prompt tokens a graphed step pads `laid` to: with its `max_batch` rows, a power of two of GEMM rows
        (the batch-invariant GEMMs' tiles: 136 rows took 1.4-2.6x the time of 128 there, and cuBLAS 1.0-1.3x;
        H200, `bench/results/invariant_kernels_h200_2026-11-30_rows.json`)."""
        return pow2_at_least(max(laid + self.max_batch, 16)) - self.max_batch

    def _layout(self, chunks: list[ChunkRead], size: int = 0, lasts: int = 0, tail: bool = True,
                run: int | None = None) -> tuple[list[int], list[int], list[int]]:
        """The prompt tokens of `chunks` as one `Tokens` part: (ids, then each token's row, position, rotary
        offset and length, as flat lists, and the index of each chunk's last token where its logits are wanted).
        Each chunk starts a run of `decode_attention.tile_queries` tokens (a run holds one row's: a run's row is
        its first token's); padding tokens read nothing and write the scratch position; padded to `size` tokens
        and `lasts` indices (a graph's shapes) where given. Not `tail`: the last chunk's run is not padded (a
        graph's padding to `size` ends it). `run`: runs of so many tokens (a larger tile's), not `self.tile`."""
        ids: list[int] = []
        rows, positions, offsets, lengths, last = [], [], [], [], []
        for i, c in enumerate(chunks):
            n = c.end - c.start
            pad = -n % (run or self.tile) if tail or i < len(chunks) - 1 else 0
            if c.logits:
                last.append(len(ids) + n - 1)
            ids += [*c.prompt.ids[c.start:c.end], *[0] * pad]
            rows += [c.row] * (n + pad)
            positions += [*range(c.start, c.end), *[self.scratch] * pad]
            offsets += [c.offset] * (n + pad)
            lengths += [*range(c.start + 1, c.end + 1), *[0] * pad]
        pad = max(size - len(ids), 0)
        ids, rows, positions = ids + [0] * pad, rows + [0] * pad, positions + [self.scratch] * pad
        offsets, lengths = offsets + [0] * pad, lengths + [0] * pad
        return ids, [*rows, *positions, *offsets, *lengths], last + [0] * max(lasts - len(last), 0)

    def _rows_input(self, rows: RowsFeed, full: bool, bucket: int) -> tuple[Tensor, tuple[int, int, int, int]]:
        """The rows' inputs on the device [bucket, T + 3] (tokens, start, rotary offset, live: padding rows write
        the scratch positions and read nothing), and (bucket, T, the T asked for, key length: the cache's whole length where `full`,
        on a GPU, so a step's sums never depend on whether it replays a graph; else rounded up from the longest
        row's). Each row's first token, start, offset and liveness stay on the device (`_state`) for the next
        step to chain on."""
        n = rows.n
        need = 1 if rows.tokens is None else len(rows.tokens[0])
        kv_len = self.positions if full else min(-(-rows.kv_need // GRAPH_BUCKET) * GRAPH_BUCKET, self.scratch + need)
        if rows.chained is not None:
            last, kept = rows.chained
            self._state[:n, 0].copy_(last)
            self._state[:n, 1] += kept
            if bucket > n:  # a bucket wider than the last step's: its extra rows idle
                self._state[n:bucket].copy_(self._padding[:bucket - n])
        else:
            # Fresh pinned memory each time (torch's host allocator reuses a block only once its copy has
            # run): one buffer kept for every step was rewritten while an earlier step's copy still
            # waited in the stream, and that step ran on the next one's tokens and positions.
            host = torch.tensor([[t[0], s, o, 1] for t, s, o in zip(rows.tokens, rows.starts, rows.offsets)]
                                + [[0, self.scratch, 0, 0]] * (bucket - n), dtype=torch.long, pin_memory=self._pinned)
            self._state[:bucket].copy_(host, non_blocking=True)
        state = self._state[:bucket]
        if need == 1:
            return state, (bucket, 1, 1, kv_len)
        after = torch.tensor([t[1:] for t in rows.tokens] + [[0] * (need - 1)] * (bucket - n), dtype=torch.long,
                             pin_memory=self._pinned).to(self.device, non_blocking=True)
        return torch.cat([state[:, :1], after, state[:, 1:]], 1), (bucket, need, need, kv_len)

    def _embeds(self, chunks: list[ChunkRead], ids: Tensor, offset: int) -> Tensor:
        """The step's input embeddings where a chunk holds an image's slots: the ids' embeddings with the
        slots' positions replaced by the image's (made on another thread's stream); `chunks` are read from
        index `offset` of the step's tokens on."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.default_stream(self.device))
            for c in chunks:
                for values in c.prompt.embeds:
                    values.record_stream(self._stream)
        embeds = self.model.embed(ids[None])
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
        """The low-bit kernels' split-K scratch and the fp32 partials of the decode attention and the batch-invariant
        GEMMs (`plugins.workspaces`): this runner's own."""
        with lowbit.using_workspace(self._lowbit_scratch), using_workspaces(self._partials_scratch):
            yield

    def _run(self, key: tuple, forward: Callable[..., Tensor | None], *inputs: Tensor | None) -> Tensor | None:
        """`forward(*inputs)` by replaying the graph captured for `key` with `inputs` copied into its own; its
        output is the graph's own buffer, reused by the next replay. Graphs are captured as the engine starts
        (`capture_table`); a step whose key is not in the table after that runs eagerly (`missed` counts them:
        a capture mid-reply costs tens of ms, and holds every other engine's captures back meanwhile)."""
        if key not in self._graphs:
            if self.ready:
                self.missed += 1
                return forward(*inputs)
            warmed = not self._graphs  # the first capture's run outside the graph does the lazy set-up for all
            try:
                self._graphs[key] = CapturedCall(forward, *inputs, pool=self._pool, warm_up=warmed)
            except Exception:
                # torch leaves a pool whose capture failed marked as recording: later captures into it would
                # all fail ("already recording to mempool_id"), so the next ones take a new pool
                self._pool = torch.cuda.graph_pool_handle()
                if warmed:
                    raise
                self._graphs[key] = CapturedCall(forward, *inputs, pool=self._pool)  # set-up left for this shape
            self.captures += 1
        graph = self._graphs[key]
        for buffer, value in zip(graph.inputs, inputs):
            if buffer is not None:
                buffer.copy_(value)
        return graph.replay()

    def table_keys(self) -> list[tuple[int, int, int]]:
        """(rows, tokens per row, prompt tokens) of every step a graph replays: 1..max_batch rows (powers of two)
        feeding one token each; max_batch rows with prompt tokens beside them (a joining prompt's chunks, padded
        so that the rows and tokens make a power of two, up to `graphed_tokens`); and 1..wide_rows rows feeding
        each wider width, alone (the engine feeds more than one token a row only while no prompt is read)."""
        batches = [1 << i for i in range(self.max_batch.bit_length()) if 1 << i <= self.max_batch]
        sizes = sorted({self._text_size(1 << i) for i in range(self.graphed_tokens.bit_length())})
        return [(b, 1, 0) for b in batches] + [(self.max_batch, 1, c) for c in sizes] + \
            [(b, width, 0) for b in batches if b <= self.wide_rows for width in self.widths[1:]]

    def capture_table(self, cache: KVCache) -> None:
        """Capture every step of `table_keys` before the engine serves (on stand-in inputs: the rows write their
        scratch positions, the prompt tokens the rows' first ones, which hold nothing yet); from then on
        nothing is captured (`ready`)."""
        for rows, per_row, size in self.table_keys():
            feed = RowsFeed(rows, [[0] * per_row] * rows, [self.scratch] * rows, [0] * rows,
                            kv_need=self.scratch + per_row)
            self.step(cache, feed, self._stand_in_chunks(size))
        self.ready = True

    def _stand_in_chunks(self, size: int) -> list[ChunkRead]:
        """Prompt chunks, each in a row of its own and inside its context, whose tokens lay out to more than the
        next smaller size (so they pad to `size`; 0: none)."""
        chunks: list[ChunkRead] = []
        smaller = (size + self.max_batch) // 2 - self.max_batch
        while size and len(self._layout(chunks, tail=False)[0]) <= smaller and len(chunks) < self.max_batch:
            n = min(smaller + 1 - len(self._layout(chunks)[0]), self.scratch - 1)
            chunks.append(ChunkRead(Prompt(tuple(range(1, n + 1))), len(chunks), 0, n, 0, logits=not chunks))
        return chunks

    def step_seconds(self, cache: KVCache, rows: int, width: int, settled: bool = False, repeats: int = 20) -> float:
        """Seconds a step of `rows` rows feeding `width` tokens each takes on this GPU (the step the graph table
        holds, in the scratch positions, which hold nothing), host work included; `settled`: each step's
        tokens read before the next is launched, as where a step's tokens decide the next one's inputs."""
        feed = RowsFeed(rows, [[0] * width] * rows, [self.scratch] * rows, [0] * rows, kv_need=self.scratch + width)
        for _ in range(3):  # a first run, and a replay
            self.step(cache, feed)
        torch.cuda.current_stream(self.device).synchronize()  # this engine's own: see `plugins.cuda_streams`
        start = time.perf_counter()
        for _ in range(repeats):
            logits, _ = self.step(cache, feed)
            if settled:
                logits[:, 0, :1].cpu()
        torch.cuda.current_stream(self.device).synchronize()
        return (time.perf_counter() - start) / repeats

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
