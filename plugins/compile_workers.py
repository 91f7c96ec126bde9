"""Triton compiles in worker processes, for a launch that compiles dozens of kernels.

Why: Triton runs a compile's passes holding the GIL, so the threads of its `AsyncCompileMode` compile
little more than one at a time: 88 kernels took 21 s on 16 cores (H200, 2026-11-29). Here the kernels a
launch asks for are first only noted (Triton's `jit_cache_hook`, which hands over each kernel's
`specialization_data`), compiled by worker processes with Triton's own `JITFunction.preload` into the file
cache they share with this process (with the C launch stub Triton builds for each signature), and then
asked for again here, where each is a read from that cache (about 16 ms). Kernels the workers compiled
once are listed (`Manifest`, in Triton's cache folder, so the list goes when that cache goes): a later
launch reads them here and starts no worker. A kernel a worker could not compile is compiled here, as
before. A 7B int4 chat from int4 weights on disk, nothing tuned: ready in 22.8 s, against 38.5 (H200,
2026-11-30, `bench/RESULTS.md`).

    python -m plugins.compile_workers   # a worker: JSON lines in (specs), JSON lines out
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from plugins.triton_cache import folder, keep

ROOT = Path(__file__).resolve().parents[1]
MAX_WORKERS = 16  # each holds torch and Triton (about 0.5 GB of RAM)


@dataclass(frozen=True)
class Spec:
    """One kernel variant to compile: the jit function by module and name, and Triton's specialization data
    (`source`: the function's own cache key, which its source changes: an edited kernel is compiled anew)."""
    module: str
    name: str
    data: str
    source: str = ""

    def digest(self, version: str) -> str:
        text = f"{version}\n{self.module}.{self.name}\n{self.source}\n{self.data}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def jit_function(module: str, name: str):
    """The JITFunction `module.name` (unwrapping Triton's heuristics and autotuners), or None."""
    from triton.runtime.jit import JITFunction

    obj = getattr(importlib.import_module(module), name, None)
    while obj is not None and not isinstance(obj, JITFunction):
        obj = getattr(obj, "fn", None)
    return obj


_noting_lock = threading.Lock()


@contextlib.contextmanager
def noting() -> Iterator[list[Spec]]:
    """While inside, this thread's compiles are noted, not done (a launch or `warmup` returns None); other
    threads compile as usual. A kernel a worker could not import by name is compiled as usual too."""
    from triton import knobs

    specs: list[Spec] = []
    me = threading.get_ident()

    with _noting_lock:
        before = knobs.runtime.jit_cache_hook

        def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            said = before(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                          already_compiled=already_compiled) if before else None
            if threading.get_ident() != me or said:
                return said
            try:
                by_name = fn.module != "__main__" and jit_function(fn.module, fn.name) is fn.jit_function
            except Exception:  # noqa: BLE001 - not importable by name: compiled here, as usual
                by_name = False
            if not by_name:
                return None
            specs.append(Spec(fn.module, fn.name, compile["specialization_data"], fn.jit_function.cache_key))
            return True

        knobs.runtime.jit_cache_hook = hook
        try:
            yield specs
        finally:
            knobs.runtime.jit_cache_hook = before


class Manifest:
    """The kernels workers have compiled into this Triton cache (digests of their specs, per Triton
    version), kept beside that cache so that a cleared cache clears it too."""

    def __init__(self):
        import triton

        self.version = triton.__version__
        self.path = folder() / "studio-compiled-in-workers.json"

    def _read(self) -> set[str]:
        try:
            return set(json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):  # none yet, or damaged: compile again
            return set()

    def missing(self, specs: list[Spec]) -> list[Spec]:
        known = self._read()
        return [s for s in dict.fromkeys(specs) if s.digest(self.version) not in known]

    def add(self, specs: list[Spec]) -> None:
        keep(self.path, json.dumps(sorted(self._read() | {s.digest(self.version) for s in specs})))


def worker_count(specs: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(specs, cores - 1, MAX_WORKERS))


class _Batch:
    """One call's specs: what was compiled, why others were not, and when every one has an answer."""

    def __init__(self, count: int, done: Callable[[], None]):
        self.left, self.done = count, done
        self.compiled: list[Spec] = []
        self.failed: list[str] = []
        self.lock, self.finished = threading.Lock(), threading.Event()
        if not count:
            self.finished.set()

    def answer(self, spec: Spec, why: str | None) -> None:
        with self.lock:
            if why is None:
                self.compiled.append(spec)
            else:
                self.failed.append(f"{spec.name}: {why}")
            self.left -= 1
            if not self.left:
                self.finished.set()
        self.done()


class WorkerPool:
    """Worker processes for one GPU, each fed by a thread of its own from one queue. They start once (a
    worker imports torch and Triton: seconds) and serve every compile of a launch (the kernels compiled while
    the weights load, the tuning candidates, the tuned step variants); each leaves after IDLE_S without work.
    Batches may be asked for at once (the tuning candidates while other kernels compile): a spec queued or
    compiling for one batch is compiled once, and its answer goes to every batch that asked."""

    IDLE_S = 60.0
    STALL_S = 300.0

    def __init__(self, device_index: int, count: int):
        self.todo: queue.Queue[Spec] = queue.Queue()
        self.asked: dict[Spec, list[_Batch]] = {}  # each spec queued or compiling, and the batches waiting for it
        self.serving, self.lock, self.why_gone = count, threading.Lock(), "no compile worker left"
        # the worker sees this GPU alone, as device 0: it compiles for its architecture and never makes a CUDA
        # context on it (that would hold GPU memory while the KV cache is sized)
        visible = visible_gpus() or []
        gpu = visible[device_index] if 0 <= device_index < len(visible) else str(device_index)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), *sys.path] if p),
                   CUDA_VISIBLE_DEVICES=gpu)
        for _ in range(count):
            threading.Thread(target=self._serve, args=(env,), daemon=True, name="compile-worker").start()

    def compile(self, specs: list[Spec], done: Callable[[], None]) -> tuple[list[Spec], list[str]]:
        """Queue `specs` and wait for their answers: until every one has one, or until none came for
        STALL_S (a worker stuck: what is left is compiled by the launch itself, which asks for them all)."""
        specs = list(dict.fromkeys(specs))
        batch = _Batch(len(specs), done)
        with self.lock:
            for spec in specs:
                if spec not in self.asked:
                    self.todo.put(spec)
                self.asked.setdefault(spec, []).append(batch)
        left, since = batch.left, time.monotonic()
        while not batch.finished.wait(1.0):
            if not self.alive():  # every worker gone: what is left is this process's to compile
                self._drain()
            if batch.left != left:
                left, since = batch.left, time.monotonic()
            elif time.monotonic() - since > self.STALL_S:
                with batch.lock:
                    return list(batch.compiled), [*batch.failed, f"{batch.left} kernels: no compile worker "
                                                                 f"answered in {self.STALL_S:.0f} s"]
        return batch.compiled, batch.failed

    def alive(self) -> bool:
        with self.lock:
            return self.serving > 0

    def _serve(self, env: dict) -> None:
        item, proc, err = None, None, None
        try:
            err = tempfile.TemporaryFile()
            proc = subprocess.Popen([sys.executable, "-m", "plugins.compile_workers"], cwd=ROOT, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
            if proc.stdout.readline().strip() != "ready":
                raise EOFError
            while True:
                try:
                    item = self.todo.get(timeout=self.IDLE_S)
                except queue.Empty:
                    return
                proc.stdin.write(json.dumps([item.module, item.name, item.data]) + "\n")
                proc.stdin.flush()
                why = json.loads(proc.stdout.readline() or "{}")  # nothing: it died
                if not isinstance(why, (str, type(None))):
                    raise EOFError
                item, spec = None, item
                self.answer(spec, why)
        except Exception:  # noqa: BLE001 - it died, could not start, or spoke garbage: the rest go to the others
            tail = ["no message"]
            with contextlib.suppress(Exception):
                err.seek(0)
                tail = err.read().decode(errors="replace").strip().splitlines()[-1:] or tail
            self.why_gone = f"a compile worker exited ({tail[0][:200]})"
            if item is not None:
                self.answer(item, self.why_gone)
        finally:
            if proc is not None:
                for pipe in (proc.stdin, proc.stdout):
                    with contextlib.suppress(OSError):
                        pipe.close()  # its loop ends
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if err is not None:
                err.close()
            with self.lock:
                self.serving -= 1
            if not self.alive():
                self._drain()

    def answer(self, spec: Spec, why: str | None) -> None:
        """`spec` compiled (`why` None) or not: every batch that asked for it is told."""
        with self.lock:
            batches = self.asked.pop(spec, [])
        for batch in batches:
            batch.answer(spec, why)

    def _drain(self) -> None:
        while True:
            try:
                spec = self.todo.get_nowait()
            except queue.Empty:
                return
            self.answer(spec, self.why_gone)


_pools: dict[int, WorkerPool] = {}
_pools_lock = threading.Lock()


def _pool(device_index: int, workers: int) -> WorkerPool:
    """This GPU's pool: the one serving, else a new one of `workers`."""
    with _pools_lock:
        pool = _pools.get(device_index)
        if pool is None or not pool.alive():
            pool = _pools[device_index] = WorkerPool(device_index, workers)
        return pool


def compile_in_workers(specs: list[Spec], device_index: int, done: Callable[[], None] = lambda: None,
                       workers: int | None = None) -> tuple[list[Spec], list[str]]:
    """Compile `specs` in this GPU's worker processes (started on first use, `WorkerPool`); `done` is called
    after each. Returns those compiled and why others were not (their first lines)."""
    return _pool(device_index, workers or worker_count(len(specs))).compile(specs, done)


def has_gpu(device_index: int = 0) -> bool:
    """An NVIDIA GPU's driver is here and this process may see GPU `device_index` (without importing torch,
    which takes seconds)."""
    visible = visible_gpus()
    if visible is not None and device_index >= len(visible):
        return False  # hidden from this process: it runs on the CPU
    return nvidia_driver()


def visible_gpus() -> list[str] | None:
    """The GPUs `CUDA_VISIBLE_DEVICES` lets this process see, or None where it is not set (all of them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else [d.strip() for d in visible.split(",") if d.strip() not in ("", "-1")]


def nvidia_driver() -> bool:
    """The NVIDIA driver's control device, or its /proc entry (a container may show only one of them)."""
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def start_early(device_index: int = 0) -> threading.Thread | None:
    """Start this GPU's workers now, from a thread, where this looks like the first launch on it (a GPU,
    Triton, and no list of kernels compiled by workers in Triton's cache): their imports (about 6 s on an
    H200 machine) then run beside the app's own, not after the load has noted its first kernels. A later
    launch starts none; workers a launch does not use leave after `WorkerPool.IDLE_S`."""
    if not has_gpu(device_index) or importlib.util.find_spec("triton") is None:
        return None

    def start() -> None:
        with contextlib.suppress(Exception):  # nothing started: the load starts its workers as before
            if not Manifest().path.exists():
                _pool(device_index, worker_count(MAX_WORKERS))

    thread = threading.Thread(target=start, daemon=True, name="compile-workers-early")
    thread.start()
    return thread


def compile_spec(spec: Spec) -> str | None:
    """Compile one spec here (a worker's work; this process's where it helps, `help_workers`): Triton's
    `preload`, and the C launch stub Triton builds for each signature (about 0.3 s; else at first launch).
    None, or why not (its first line)."""
    try:
        fn = jit_function(spec.module, spec.name)
        if fn is None:
            raise LookupError(f"no Triton kernel {spec.module}.{spec.name}")
        kernel = fn.preload(spec.data)
    except Exception as e:  # noqa: BLE001 - told to the launch, which compiles it itself
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    with contextlib.suppress(Exception):  # a stub not built here is built at the kernel's first launch
        from triton.runtime.driver import driver
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    return None


def help_workers(device_index: int, until: Callable[[], bool]) -> None:
    """Take this GPU's queued specs and compile them in this thread until `until()` (checked at least every
    half second): for a launch with nothing else to do (waiting for its compiles) while the workers are still
    starting (their imports take seconds)."""
    cuda = importlib.import_module("torch").cuda
    if cuda.is_available() and device_index < cuda.device_count():
        cuda.set_device(device_index)  # Triton compiles for the thread's current device
    while not until():
        pool = _pools.get(device_index)
        if pool is None:  # the launch is still noting its kernels
            time.sleep(0.5)
            continue
        try:
            spec = pool.todo.get(timeout=0.5)
        except queue.Empty:
            continue
        pool.answer(spec, compile_spec(spec))


def _work() -> None:
    """A worker's loop: "ready" once its imports are in, then a JSON line [module, name, specialization
    data] in, null or why not out (on its own copy of stdout: anything printed goes to stderr)."""
    importlib.import_module("torch")  # Triton's CUDA driver asks torch for the device: imported first, once

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        module, name, data = json.loads(line)
        out.write(json.dumps(compile_spec(Spec(module, name, data))) + "\n")
        out.flush()


if __name__ == "__main__":
    _work()
