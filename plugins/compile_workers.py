"""Triton compiles in worker processes, for a launch that compiles dozens of kernels.

Why: Triton runs a compile's passes holding the GIL, so the threads of its `AsyncCompileMode` compile
little more than one at a time: 88 kernels took 21 s on 16 cores (H200, 2026-11-29). Here the kernels a
launch asks for are first only noted (Triton's `jit_cache_hook`, which hands over each kernel's
`specialization_data`), compiled by worker processes with Triton's own `JITFunction.preload` into the file
cache they share with this process, and then asked for again here, where each is a read from that cache
(about 16 ms). Kernels the workers compiled once are listed (`Manifest`, in Triton's cache folder, so the
list goes when that cache goes): a later launch reads them here and starts no worker. A kernel a worker
could not compile is compiled here, as before.

    python -m plugins.compile_workers DEVICE_INDEX   # a worker: JSON lines in (specs), JSON lines out
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_WORKERS = 16  # each holds torch and Triton (about 0.5 GB of RAM)


@dataclass(frozen=True)
class Spec:
    """One kernel variant to compile: the jit function by module and name, and Triton's specialization data."""
    module: str
    name: str
    data: str

    def digest(self, version: str) -> str:
        return hashlib.sha256(f"{version}\n{self.module}.{self.name}\n{self.data}".encode()).hexdigest()[:32]


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
            if fn.module == "__main__" or jit_function(fn.module, fn.name) is not fn.jit_function:
                return None
            specs.append(Spec(fn.module, fn.name, compile["specialization_data"]))
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
        self.path = Path(triton.knobs.cache.dir) / "studio-compiled-in-workers.json"

    def _read(self) -> set[str]:
        try:
            return set(json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):  # none yet, or damaged: compile again
            return set()

    def missing(self, specs: list[Spec]) -> list[Spec]:
        known = self._read()
        return [s for s in dict.fromkeys(specs) if s.digest(self.version) not in known]

    def add(self, specs: list[Spec]) -> None:
        known = self._read() | {s.digest(self.version) for s in specs}
        with contextlib.suppress(OSError):  # a list not written costs the next launch workers, nothing else
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(sorted(known)))
            os.replace(tmp, self.path)


def worker_count(specs: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(specs, cores - 1, MAX_WORKERS))


def compile_in_workers(specs: list[Spec], device_index: int, done: Callable[[], None] = lambda: None,
                       workers: int | None = None) -> tuple[list[Spec], list[str]]:
    """Compile `specs` in worker processes (one after another in each, every worker taking the next);
    `done` is called after each. Returns those compiled and why others were not (their first lines)."""
    todo: queue.Queue[Spec] = queue.Queue()
    for spec in specs:
        todo.put(spec)
    compiled: list[Spec] = []
    failed: list[str] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), *sys.path] if p))

    def serve() -> None:
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([sys.executable, "-m", "plugins.compile_workers", str(device_index)],
                                    cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                    text=True)
            try:
                while True:
                    try:
                        spec = todo.get_nowait()
                    except queue.Empty:
                        return
                    proc.stdin.write(json.dumps([spec.module, spec.name, spec.data]) + "\n")
                    proc.stdin.flush()
                    answer = proc.stdout.readline()
                    if not answer:  # the worker died: its spec (and its share) go to the others or here
                        err.seek(0)
                        tail = err.read().decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
                        failed.append(f"{spec.name}: a compile worker exited ({tail[0][:200]})")
                        return
                    why = json.loads(answer)
                    if why is None:
                        compiled.append(spec)
                    else:
                        failed.append(f"{spec.name}: {why}")
                    done()
            except OSError as e:  # a broken pipe: as a worker that died
                failed.append(f"a compile worker failed: {type(e).__name__}: {e}")
            finally:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # its loop ends
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()

    threads = [threading.Thread(target=serve, daemon=True, name="compile-worker")
               for _ in range(workers or worker_count(len(specs)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return compiled, failed


def _work(device_index: int) -> None:
    """A worker's loop: a JSON line [module, name, specialization data] in, null or why not out."""
    import torch  # Triton's CUDA driver asks torch for the current device

    if device_index >= 0:
        torch.cuda.set_device(device_index)
    for line in sys.stdin:
        try:
            module, name, data = json.loads(line)
            fn = jit_function(module, name)
            if fn is None:
                raise LookupError(f"no Triton kernel {module}.{name}")
            fn.preload(data)
            why = None
        except Exception as e:  # noqa: BLE001 - told to the launch, which compiles it itself
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        sys.stdout.write(json.dumps(why) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _work(int(sys.argv[1]))
