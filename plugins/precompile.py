"""Compiling the kernels a model's steps can use at load (the low-bit ones, the decode attention's, the
sampler's), all at once on every CPU core.

Why: Triton compiles a kernel at its first launch, once for each distinct set of compile-time values:
the constexprs (tile, loop step, rows per launch), and of the other arguments whether an integer is 1
or a multiple of 16 and whether a pointer is 16-byte aligned. One after another that took a first
launch of a 7B int4 chat tens of seconds, most of it in the speculative verify step's several-row
GEMVs ("decode step ready in 37–43 s", H100, 2026-11-27). Here every variant a step can launch is
listed per distinct layer shape (`step_calls`) and compiled all at once (`ask`): those not compiled
before in worker processes (`plugins.compile_workers`), then every one asked for in Triton's
`AsyncCompileMode` here (read from the cache the workers wrote), with progress in the terminal and
through the loader's `say`; later steps (and their CUDA graph captures) find them compiled. Variants no
step launches are not compiled (`tests/test_precompile.py`). With it no low-bit or attention kernel
compiled one at a time in a first launch any more (H200, 2026-11-27, `bench/RESULTS.md`, "Quick to start").

Two moments (`studio.backends.torch_decoder`): while the weights are still being read or quantized,
threads of their own (`Background`) compile what needs no weights (layer stand-ins,
`LowBitWeight.stand_in`: on a new GPU the tuning candidates first, so that tuning starts while the rest
compile; every step variant where the tuned configs are on disk); after tuning, `compile_steps` compiles
the step variants of the tuned configs that are not compiled yet, and shows their progress.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from concurrent.futures import Future, ThreadPoolExecutor, as_completed

import torch
from tqdm.auto import tqdm

from plugins.compile_workers import Manifest, compile_in_workers, help_workers, noting
from plugins.triton_cache import remember_key
from plugins.decode_attention import LONG_TILE_ROWS, TILE_ROWS, decode_attention
from plugins.fused import (add_rms_norm_fused, compiling_ahead, rms_norm_fused, rope_cache_write_fused, rotary_fused,
                           silu_mul_fused)
from plugins.topk_sampling import sample_top_k
from plugins.lowbit import BLOCK_M, Config, LowBitWeight, rows_as_one_row, triton

# A speculative verify step of one chat: its last token and k drafted ones, as one-row launches
# (`rows_as_one_row`). The draft sizes k are defined here, once: the engine drafts only these
# (`pipeline.llm.engine.speculation.DRAFT_SIZES`), so these are all the verify kernels it launches.
VERIFY_ROWS = (2, 3, 5, 9)
# Representative row counts for the tensor-core kernel: every count in a class compiles to one kernel
# (the rows are a value, but Triton compiles a multiple of 16 apart): 2–15 and 16 rows (the batch
# shape, `batch_config`: decode batches, a verify step of several chats, short prompts); more rows
# (prefill tiles, `prefill`), not a multiple of 16 and a multiple.
BATCH_ROWS = (8, BLOCK_M)
PREFILL_ROWS = (BLOCK_M + 1, 2 * BLOCK_M)

# a layer, rows, as one-row launches, the launch shape; or a call that asks for other kernels (`compile_only`)
Case = tuple[LowBitWeight, int, bool, Config] | Callable[[], object]


def step_calls(layer: LowBitWeight, verify: bool) -> list[tuple[int, bool, Config]]:
    """(rows, as one-row launches, config) of calls that launch, between them, every kernel variant a step
    can launch on `layer` with its current configs: one row (a chat's decode step, a prompt's last
    position), a verify step's rows as one-row launches (`verify`: the engine speculates), the batch
    kernel's two row classes and the prefill tiles' two."""
    calls = [(1, False, layer.config)]
    calls += [(rows, True, layer.config) for rows in VERIFY_ROWS] if verify else []
    calls += [(rows, False, layer.batch_config) for rows in BATCH_ROWS]
    calls += [(rows, False, layer.prefill) for rows in PREFILL_ROWS]
    return calls


def prefill_calls(layer: LowBitWeight) -> list[tuple[int, bool, Config]]:
    """The calls of `step_calls` that tuning does not change (prefill tiles have one launch shape)."""
    return [(rows, False, layer.prefill) for rows in PREFILL_ROWS]


def distinct_shapes(weights: Iterable[LowBitWeight]) -> list[LowBitWeight]:
    """One layer per shape key: layers alike have the same configs, so the same kernels."""
    return list({w.shape_key(): w for w in weights}.values())


def attention_calls(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                    verify: bool) -> list[Callable[[], object]]:
    """Calls that compile the decode-attention kernels a step launches (`plugins.decode_attention`: one
    query per cache row, prompt tokens (each query its row's; in both tiles), and `verify`: a verify step's
    VERIFY_ROWS per row, with every merge width), from stand-in tensors of a few bytes: those kernels compile
    for the dtypes, the heads, head_dim and the queries per row (or prompt tokens' tile) only."""
    def call(tokens: int, tile_rows: int = 0) -> None:  # tile_rows: prompt tokens in tiles of so many rows
        q = torch.empty(tokens, heads, head_dim, dtype=dtype, device=device)
        cache = torch.empty(1, kv_heads, 16, head_dim, dtype=dtype, device=device)
        lengths = torch.ones(tokens, dtype=torch.long, device=device)
        rows = torch.zeros(tokens, dtype=torch.long, device=device) if tile_rows else None
        decode_attention(q, cache, cache, lengths, 16, tokens=tokens, rows=rows, compile_only=True,
                         tile_rows=tile_rows or TILE_ROWS)

    return [functools.partial(call, 1, tile_rows=tile) for tile in (TILE_ROWS, LONG_TILE_ROWS)] + \
        [functools.partial(call, tokens) for tokens in (1, *(VERIFY_ROWS if verify else ()))]


def sampling_calls(vocabs: Iterable[int], dtype: torch.dtype, device: torch.device) -> list[Callable[[], object]]:
    """Calls that compile the sampler's two kernels (`plugins.topk_sampling`) for logits in the model's dtype
    and in float32 (after a frequency penalty), over each of `vocabs` entries (the pick kernel's block count
    is a constant there): the model's logits, and the tokenizer's vocabulary where the engine cuts them to it."""
    def call(vocab: int, logits_dtype: torch.dtype) -> None:
        sample_top_k(torch.empty(1, vocab, dtype=logits_dtype, device=device),
                     torch.empty(1, vocab, dtype=torch.bool, device=device),
                     torch.empty(5, 1, dtype=torch.float32, device=device), compile_only=True)

    return [functools.partial(call, v, d) for v in dict.fromkeys(vocabs) for d in dict.fromkeys((dtype, torch.float32))]


def fused_calls(config: Any, dtype: torch.dtype, device: torch.device) -> list[Callable[[], object]]:
    """Calls that compile the fused kernels a step launches (`plugins.fused`: the two norms, SiLU·up, RoPE of
    prompt tokens, and RoPE with the KV-cache write of decode rows, their positions at a 16-byte boundary or
    not), from stand-ins of a step's tensors (a row of the fused q/k/v output's views): they compile for the
    dtypes, the alignments and the model's widths (`config`: a `DecoderConfig`); the first step compiled them
    one at a time (1–2 s with their launch stubs, H200 2026-11-30)."""
    h, kv, d, n = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size

    def empty(*shape: int, of: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=of, device=device)

    def qkv(rows: int, tokens: int) -> tuple[torch.Tensor, ...]:
        fused = empty(rows, tokens, (h + 2 * kv) * d)
        return fused[..., :h * d].view(rows, tokens, h, d), fused[..., h * d:(h + kv) * d].view(rows, tokens, kv, d), \
            fused[..., (h + kv) * d:].view(rows, tokens, kv, d)

    def call() -> None:
        with compiling_ahead():
            x, weight, cos = empty(2, n), empty(n), empty(2, 1, d, of=torch.float32)
            rms_norm_fused(x, weight, 1e-6)
            add_rms_norm_fused(x, empty(2, n), weight, 1e-6)
            silu_mul_fused(empty(2, 2 * config.intermediate_size))
            q, k, _ = qkv(1, 2)
            rotary_fused(q, cos, cos)
            rotary_fused(k, cos, cos)
            cache = empty(2, kv, 16, d)
            for positions in (empty(2, of=torch.long), empty(3, of=torch.long)[1:]):
                rope_cache_write_fused(*qkv(2, 1), cos, cos, cache, cache, positions)

    return [call]


def model_calls(config: Any, dtype: torch.dtype, device: torch.device, verify: bool,
                vocab: int) -> list[Callable[[], object]]:
    """Every call above for one model (`config`: a `DecoderConfig`; `vocab`: the tokenizer's)."""
    return attention_calls(config.num_heads, config.num_kv_heads, config.head_dim, dtype, device, verify) + \
        sampling_calls((config.vocab_size, vocab or config.vocab_size), dtype, device) + \
        fused_calls(config, dtype, device)


def issue(cases: Iterable[Case]) -> list[str]:
    """Ask for each case's kernels with `compile_only` (in `AsyncCompileMode`: queued, not waited for);
    returns why any could not be asked for (left to compile at its first launch)."""
    failed = []
    for case in cases:
        try:
            if callable(case):
                case()
                continue
            layer, rows, as_one_row, config = case
            x = torch.empty(rows, layer.in_features - layer.pad, device=layer.data.device, dtype=layer.dtype)
            with rows_as_one_row(as_one_row):
                layer(x, config, compile_only=True)
        except Exception as e:  # noqa: BLE001 - compiling ahead is an optimisation: the launch compiles it
            what = f"{case[0].shape_key()} {case[1]} rows" if isinstance(case, tuple) else "attention or sampling"
            failed.append(f"{what}: {type(e).__name__}: {e}")
    return failed


def ask(cases: list[Case], device: torch.device, noted: Callable[[int], None] = lambda count: None,
        done: Callable[[], None] = lambda: None) -> list[str]:
    """`issue` the cases in this process, their kernels not compiled yet first compiled in worker processes
    (`plugins.compile_workers`: `noted` is told how many, `done` after each), so that here each is a read
    from Triton's cache; returns why any could not be asked for, or compiled in a worker (then here)."""
    failed: list[str] = []
    try:
        if device.type == "cuda":
            remember_key()  # before the first kernel is looked up in Triton's cache
            with noting() as specs:
                issue(cases)
            manifest = Manifest()
            todo = manifest.missing(specs)
            if todo:
                noted(len(todo))
                compiled, failed = compile_in_workers(todo, _gpu_index(device), done)
                manifest.add(compiled)
    except Exception as e:  # noqa: BLE001 - the workers are a speed-up: every kernel is asked for here anyway
        failed.append(f"compile workers: {type(e).__name__}: {e}")
    return failed + issue(cases)


def _gpu_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


class _Pool(ThreadPoolExecutor):
    """A thread pool that keeps the futures of what it was given (one per compile Triton starts), and holds
    it until `start`: asking for the kernels is Python work of the asking thread, and Triton's compiles
    hold the GIL much of their time, so asked for while they ran it took seconds (12 variants: 4 s), and the
    loader's own work beside them (repacking the weights: 12 s, 0.02 s alone; H200, 2026-11-27)."""

    def __init__(self):
        super().__init__(max_workers=os.cpu_count() or 4, thread_name_prefix="triton-compile")
        self.futures: list[Future] = []
        self._held: list[tuple] | None = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._held is None:
            future = super().submit(fn, *args, **kwargs)
        else:
            future = Future()
            self._held.append((future, fn, args, kwargs))
        self.futures.append(future)
        return future

    def start(self) -> None:
        """Run what was held (and from now on, what is given at once)."""
        held, self._held = self._held or [], None
        for future, fn, args, kwargs in held:
            super().submit(_run_into, future, fn, args, kwargs)


def _run_into(future: Future, fn, args, kwargs) -> None:
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the future carries it to whoever waits (Triton: ignored)
            future.set_exception(e)


def _mode():
    return getattr(triton, "AsyncCompileMode", None) if triton is not None else None


def compile_now(cases: list[Case], say: Callable[[str], None], what: str) -> int:
    """Compile every kernel `cases` launch that is not compiled yet, all at once (`ask`; those the background
    compiles of the same `what` were given are waited for, others asked for beside them, each compiled once:
    `compile_workers.WorkerPool`); returns how many were asked for. Where this Triton lacks `AsyncCompileMode`
    each compiles at its first launch."""
    settle(say, what)
    mode = _mode()
    if mode is None or not cases:
        return 0
    start, pool = time.perf_counter(), _Pool()
    with pool, mode(pool, ignore_errors=True), \
            tqdm(total=0, desc=f"compiling {what}", unit="kernel", file=sys.stderr) as bar:
        def noted(count: int) -> None:
            say(f"compiling {count} {what} in worker processes")
            bar.total = count
            bar.refresh()

        try:
            failed = ask(cases, _device_of(cases), noted, bar.update)
        finally:
            pool.start()
        bar.total += len(pool.futures)
        for _ in as_completed(pool.futures):
            bar.update()
    if failed:
        say(f"{len(failed)} {what} compiled in this process or at first use ({failed[0]})")
    if pool.futures:
        say(f"compiled {len(pool.futures)} {what} in {time.perf_counter() - start:.1f} s")
    return len(pool.futures)


def _device_of(cases: list[Case]) -> torch.device:
    layer = next((case[0] for case in cases if isinstance(case, tuple)), None)
    return layer.data.device if layer is not None else \
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def compile_steps(weights: Iterable[LowBitWeight], verify: bool, say: Callable[[str], None] = lambda line: None) -> int:
    """Compile the kernel variants a step can launch on these layers (`step_calls`, per distinct shape,
    with their tuned configs) that are not compiled yet; how many were."""
    cases = [(w, *call) for w in distinct_shapes(weights) for call in step_calls(w, verify)]
    return compile_now(cases, say, "low-bit kernel variants the steps use")


class Background:
    """Compiles running on all cores in a thread of their own while the caller goes on (reading weights):
    the kernels are in Triton's cache from the moment they are asked for (a launch meanwhile waits for its
    own), finished by `settle`."""

    def __init__(self, cases: list[Case], device: torch.device, what: str):
        self.what, self.started, self.finished, self.failed = what, time.perf_counter(), None, []
        self.pool = _Pool()
        self.in_workers, self.worked = 0, 0  # kernels given to worker processes, and compiled there
        self.device_index = _gpu_index(device) if device.type == "cuda" else None
        self.thread = threading.Thread(target=self._run, args=(cases, device), daemon=True, name="kernel compiles")
        _running.append(self)
        self.thread.start()

    def _run(self, cases: list[Case], device: torch.device) -> None:
        try:
            if self.device_index is not None:
                torch.cuda.set_device(self.device_index)  # Triton compiles for the thread's current device
            with self.pool, _mode()(self.pool, ignore_errors=True):
                try:
                    self.failed = ask(cases, device, self._noted, self._done)
                finally:
                    self.pool.start()
        except Exception as e:  # noqa: BLE001 - as in `issue`: what did not compile compiles at its launch
            self.failed.append(f"{type(e).__name__}: {e}")
        self.finished = time.perf_counter()

    def _noted(self, count: int) -> None:
        self.in_workers = count

    def _done(self) -> None:
        self.worked += 1

    def _progress(self) -> tuple[int, int]:
        return self.worked + sum(f.done() for f in self.pool.futures), self.in_workers + len(self.pool.futures)

    def wait(self, say: Callable[[str], None]) -> None:
        """Until every compile has finished, with a bar of those left; meanwhile threads of this process
        compile too, while the worker processes start (`help_workers`; not before: beside the loader's own
        work they slow it)."""
        helpers = [threading.Thread(target=help_workers, args=(self.device_index, lambda: not self.thread.is_alive()),
                                    daemon=True, name="triton-compile") for _ in range(os.cpu_count() or 4)]
        for helper in helpers:
            helper.start()
        if self.thread.is_alive():
            with tqdm(total=self._progress()[1], desc=f"compiling {self.what}", unit="kernel", file=sys.stderr) as bar:
                while self.thread.is_alive():
                    bar.total, n = self._progress()[1], self._progress()[0]
                    bar.update(n - bar.n)
                    self.thread.join(0.1)
                bar.total = self._progress()[1]
                bar.update(bar.total - bar.n)
        if self.failed:
            say(f"{len(self.failed)} {self.what} compiled in this process or at first use ({self.failed[0]})")
        took = (self.finished or time.perf_counter()) - self.started
        workers = f"; {self.in_workers} compiled in worker processes" if self.in_workers else ""
        say(f"compiled {len(self.pool.futures)} {self.what} while the weights loaded ({took:.1f} s{workers})")


_running: list[Background] = []


def compile_in_background(cases: list[Case], device: torch.device, what: str) -> Background | None:
    """Start compiling `cases`' kernels in the background (see `Background`); None where this Triton cannot."""
    if _mode() is None or not cases:
        return None
    return Background(cases, device, what)


def settle(say: Callable[[str], None] = lambda line: None, what: str | None = None) -> None:
    """Wait for the compiles started in the background (those of `what` alone, where given): before the kernels
    are timed or launched."""
    for job in [job for job in _running if what in (None, job.what)]:
        job.wait(say)
        _running.remove(job)
