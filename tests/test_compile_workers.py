"""Compile worker processes (`plugins/compile_workers.py`): what a launch is told when a worker cannot
compile, and the list of kernels the workers compiled into Triton's cache. The workers compiling real
kernels that this process then reads from the cache is the GPU test
`test_kernels_compiled_in_worker_processes_are_read_from_the_cache_here` (tests/test_gpu.py)."""

import json
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

from plugins.compile_workers import Manifest, Spec, compile_in_workers, worker_count  # noqa: E402

A, B = Spec("plugins.lowbit", "_gemv_kernel", '{"a": 1}'), Spec("plugins.lowbit", "_gemv_kernel", '{"a": 2}')


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_manifest_lists_what_workers_compiled_for_this_triton_only(triton_cache):
    manifest = Manifest()
    assert manifest.path.parent == triton_cache  # cleared with the cache it describes
    assert manifest.missing([A, B, A]) == [A, B]
    manifest.add([A])
    assert Manifest().missing([A, B]) == [B]
    other_triton = Manifest()
    other_triton.version = "0.0.0"
    assert other_triton.missing([A, B]) == [A, B]


def test_a_damaged_manifest_means_compile_again(triton_cache):
    Manifest().add([A])
    Manifest().path.write_text("{not json")
    assert Manifest().missing([A]) == [A]
    Manifest().add([B])  # and is replaced by a good one
    assert json.loads(Manifest().path.read_text()) and Manifest().missing([A, B]) == [A]


def test_a_kernel_a_worker_cannot_compile_is_told_with_its_reason(triton_cache):
    done = []
    missing = Spec("plugins.lowbit", "no_such_kernel", "{}")
    not_a_kernel = Spec("plugins.lowbit", "LowBitWeight", "{}")
    compiled, failed = compile_in_workers([missing, not_a_kernel], -1, lambda: done.append(1), workers=1)
    assert compiled == [] and len(done) == 2
    assert failed == ["no_such_kernel: LookupError: no Triton kernel plugins.lowbit.no_such_kernel",
                      "LowBitWeight: LookupError: no Triton kernel plugins.lowbit.LowBitWeight"]


def test_a_worker_that_dies_is_told_and_its_kernels_left_to_this_process(triton_cache, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # a worker that exits at once, saying nothing
    done = []
    compiled, failed = compile_in_workers([A, B], 7, lambda: done.append(1), workers=2)
    assert compiled == [] and len(done) == 2
    assert failed == ["_gemv_kernel: a compile worker exited (no message)"] * 2


def _within(seconds: float, fn):
    """fn()'s result, or a failure where it has not returned in `seconds` (a hang is the bug tested for)."""
    import threading

    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the launch was left waiting for its compile workers"
    return result[0]


def test_a_worker_that_cannot_start_or_answers_garbage_does_not_hold_the_launch(triton_cache, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    compiled, failed = _within(60, lambda: compile_in_workers([A], 11, workers=1))
    assert compiled == [] and failed == ["_gemv_kernel: a compile worker exited (no message)"]
    garbage = tmp_path / "garbage-worker"
    garbage.write_text("#!/bin/sh\necho ready\nread line\necho 'not json'\n")
    garbage.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(garbage))
    compiled, failed = _within(60, lambda: compile_in_workers([A, B], 12, workers=1))
    assert compiled == [] and failed == ["_gemv_kernel: a compile worker exited (no message)"] * 2


def test_a_kernel_two_batches_ask_for_at_once_is_compiled_once_and_both_are_told(triton_cache, monkeypatch, tmp_path):
    """The tuning candidates are asked for while the other kernels compile: a spec queued (or compiling) for one
    batch is not queued again for another; its one answer reaches both. The worker here answers once a file
    exists, so the second batch is asked while the first is still waiting."""
    import threading

    from plugins import compile_workers

    go, log = tmp_path / "go", tmp_path / "asked.log"
    worker = tmp_path / "waiting-worker"
    worker.write_text(f'#!/bin/sh\necho ready\nwhile read -r line; do\n  while [ ! -f "{go}" ]; do sleep 0.05; done\n'
                      f'  printf "%s\\n" "$line" >> "{log}"\n  echo null\ndone\n')
    worker.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(worker))
    C = Spec("plugins.lowbit", "_gemv_kernel", '{"a": 3}')
    results: dict[str, tuple] = {}
    first = threading.Thread(target=lambda: results.update(first=compile_in_workers([A, B], 13, workers=1)))
    first.start()
    while set(compile_workers._pools.get(13, compile_workers.WorkerPool(13, 0)).asked) != {A, B}:
        first.join(0.01)
    second = threading.Thread(target=lambda: results.update(second=compile_in_workers([B, C, C], 13)))
    second.start()
    while len(compile_workers._pools[13].asked.get(C, [])) != 1:
        second.join(0.01)
    go.touch()
    first.join()
    second.join()
    assert results == {"first": ([A, B], []), "second": ([B, C], [])}
    assert sorted(json.loads(line)[2] for line in log.read_text().splitlines()) == [A.data, B.data, C.data]


def test_the_workers_serve_call_after_call_until_idle(triton_cache):
    from plugins import compile_workers

    compile_in_workers([Spec("plugins.lowbit", "no_such_kernel", "{}")], -1, workers=1)
    pool = compile_workers._pools[-1]
    assert pool.alive()
    _, failed = compile_in_workers([Spec("plugins.lowbit", "nor_this", "{}")], -1)
    assert compile_workers._pools[-1] is pool and failed[0].startswith("nor_this: LookupError")


def test_this_process_compiles_queued_kernels_while_the_workers_start(triton_cache, monkeypatch, tmp_path):
    """`help_workers`: a launch waiting for its compiles takes queued kernels itself while the workers are
    still importing (here: never ready). Its kernel, importable here only, shows who compiled it."""
    import threading
    import types

    import triton
    from plugins import compile_workers
    from plugins.compile_workers import help_workers

    @triton.jit
    def kernel(x):
        pass

    monkeypatch.setitem(sys.modules, "helped_kernels", types.ModuleType("helped_kernels"))
    sys.modules["helped_kernels"].kernel = kernel
    slow = tmp_path / "slow-worker"
    slow.write_text("#!/bin/sh\nsleep 5\n")
    slow.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow))
    result = []
    asking = threading.Thread(target=lambda: result.append(compile_in_workers(
        [Spec("helped_kernels", "kernel", "{}")], 9, workers=1)))
    asking.start()
    while not compile_workers._pools.get(9):
        asking.join(0.1)
    help_workers(9, lambda: not asking.is_alive())
    asking.join()
    (compiled, failed), = result
    # Triton's preload here failed on this data (no GPU, or no name in it): not a worker, which could not import it
    assert compiled == [] and len(failed) == 1 and failed[0].startswith("kernel: "), failed
    assert "helped_kernels" not in failed[0] and "exited" not in failed[0], failed


def test_workers_are_one_per_spare_core_at_most():
    assert worker_count(1) == 1
    assert 1 <= worker_count(1000) <= 16


def test_a_first_launch_on_a_gpu_starts_its_workers_as_the_process_starts(triton_cache, monkeypatch):
    """`start_early` (launch.py, before the app's imports): on a GPU with nothing compiled by workers yet,
    the pool starts at once and the load's kernels go to it; a later launch, or one on the CPU, starts none."""
    from plugins import compile_workers
    from plugins.compile_workers import start_early

    monkeypatch.setattr(compile_workers, "worker_count", lambda specs: 1)
    monkeypatch.setattr(compile_workers, "has_gpu", lambda index: False)
    assert start_early(21) is None and 21 not in compile_workers._pools
    monkeypatch.setattr(compile_workers, "has_gpu", lambda index: True)
    start_early(21).join()
    pool = compile_workers._pools[21]
    assert pool.alive()
    _, failed = compile_in_workers([Spec("plugins.lowbit", "no_such_kernel", "{}")], 21)
    assert compile_workers._pools[21] is pool and failed[0].startswith("no_such_kernel: LookupError")
    Manifest().add([A])  # a later launch: its kernels were compiled by workers
    start_early(22).join()
    assert 22 not in compile_workers._pools


def test_the_launch_starts_compile_workers_for_the_gpu_its_model_loads_on():
    from studio.early_start import gpu_index

    assert gpu_index([]) == 0 and gpu_index(["chat"]) == 0
    assert gpu_index(["--device", "cuda:1", "--port", "8080"]) == 1 and gpu_index(["--device=cuda:2"]) == 2
    assert gpu_index(["--device", "cpu"]) is None and gpu_index(["--check"]) is None
    assert gpu_index(["--device", "cuda:x"]) == 0  # a wrong name: the app itself says what is wrong


def test_a_gpu_hidden_from_the_process_starts_no_compile_worker(monkeypatch):
    from plugins import compile_workers
    from plugins.compile_workers import has_gpu

    monkeypatch.setattr(compile_workers, "nvidia_driver", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert has_gpu(0)
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not has_gpu(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert has_gpu(0) and not has_gpu(1)  # the process sees one GPU, as its device 0
