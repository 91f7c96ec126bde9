"""The gate between CUDA graph captures and other threads' GPU work (`plugins.cuda_streams`), with threads and
events only (no GPU): a capture waits for other threads' launching to end and holds new launching back, a
thread's own nested launching passes, and two threads that launch and both capture do not wait on each other."""

import threading

from plugins.cuda_streams import _CaptureGate

WAIT = 30  # seconds: only for a broken gate to fail instead of hanging; no verdict depends on it


def started(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def until(condition) -> None:
    done = threading.Event()
    while not condition():
        done.wait(0.001)


def test_a_capture_waits_for_other_threads_launching_and_holds_new_launching_back():
    gate, order = _CaptureGate(), []
    inside, leave, captured, let_capture_end = (threading.Event() for _ in range(4))

    def launcher():
        with gate.launching():
            inside.set()
            leave.wait(WAIT)
            order.append("launch ended")

    def capturer():
        with gate.capturing():
            order.append("captured")
            with gate.launching():  # its own launching within the capture passes
                order.append("capturer launched")
            captured.set()
            let_capture_end.wait(WAIT)

    a = started(launcher)
    inside.wait(WAIT)
    b = started(capturer)
    until(lambda: gate._capturer is not None)  # it waits for the launcher now
    leave.set()
    captured.wait(WAIT)
    def late_launcher():
        with gate.launching():
            order.append("late launch")

    late = started(late_launcher)
    until(lambda: not late.is_alive() or len(gate._cond._waiters) > 0)  # done, or waiting at the gate
    assert order == ["launch ended", "captured", "capturer launched"]  # the late one waits for the capture
    let_capture_end.set()
    for t in (a, b, late):
        t.join(WAIT)
    assert order == ["launch ended", "captured", "capturer launched", "late launch"]


def test_two_launching_threads_that_both_capture_do_not_wait_on_each_other():
    gate, done = _CaptureGate(), []
    both_inside = threading.Barrier(2)

    def engine(name: str):
        with gate.launching():
            both_inside.wait(WAIT)
            with gate.capturing():
                done.append(name)

    threads = [started(lambda n=n: engine(n)) for n in ("chat", "draft")]
    for t in threads:
        t.join(WAIT)
    assert sorted(done) == ["chat", "draft"]


def test_a_thread_already_launching_goes_on_while_a_capture_waits_for_it():
    gate, order = _CaptureGate(), []
    inside, go_on = threading.Event(), threading.Event()

    def launcher():
        with gate.launching():
            inside.set()
            go_on.wait(WAIT)
            with gate.launching():  # a nested step part: it must not wait for the capture that waits for it
                order.append("nested")

    def capturer():
        with gate.capturing():
            order.append("captured")

    a = started(launcher)
    inside.wait(WAIT)
    b = started(capturer)
    until(lambda: gate._capturer is not None)
    go_on.set()
    for t in (a, b):
        t.join(WAIT)
    assert order == ["nested", "captured"]
