"""What the app's threads must not do while another thread captures a CUDA graph (`plugins.cuda_streams`): no
gate holds their GPU work back, so the two things that break a capture are kept out of the sources (read here:
CI has no GPU; `tests/test_gpu.py` runs captures beside each kind of work that is allowed). And captures run
one at a time."""

import re
import threading
from pathlib import Path

from plugins.cuda_streams import capturing

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("app", "pipeline", "plugins", "engine_builder", "studio")
                 for p in (ROOT / folder).rglob("*.py")) + [ROOT / "launch.py"]
DRAW = re.compile(r"torch\.(rand|randn|randint|randperm|rand_like|randn_like|multinomial|bernoulli|normal)\(|"
                  r"\.(uniform_|normal_|exponential_|random_|geometric_|bernoulli_|cauchy_|log_normal_)\(")


def _calls(text: str, pattern: re.Pattern) -> list[str]:
    """Each call matching `pattern`, with its arguments (up to its closing parenthesis)."""
    found = []
    for match in pattern.finditer(text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        found.append(text[match.start():end + 1])
    return found


def test_no_thread_synchronizes_the_whole_device():
    """A device-wide synchronize in any thread invalidates another thread's capture (H200, 2026-11-30): the
    app waits on its own stream or an event."""
    offenders = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in SOURCES
                 for line in p.read_text().splitlines() if "torch.cuda.synchronize(" in line or "import synchronize" in line]
    assert not offenders, offenders


def test_no_draw_on_the_gpu_comes_from_torch_s_default_generator():
    """A draw from torch's default CUDA generator fails while another thread captures (every capture registers
    that generator): random numbers made on a device come from a generator of the caller's own."""
    offenders = [f"{p.relative_to(ROOT)}: {call}" for p in SOURCES for call in _calls(p.read_text(), DRAW)
                 if "device" in call and "generator=" not in call]
    assert not offenders, offenders


def test_the_source_reading_finds_what_it_looks_for():
    """The two readings above flag what they are meant to (else they would pass on anything)."""
    flagged = _calls("x = torch.randn(4, 8, device=w.device, dtype=w.dtype)  # (a comment)", DRAW)
    assert flagged == ["torch.randn(4, 8, device=w.device, dtype=w.dtype)"]
    assert _calls("p.normal_(0, torch.ones(2).sum())", DRAW) == [".normal_(0, torch.ones(2).sum())"]


def test_captures_run_one_at_a_time():
    """Two threads that capture at once: the second starts only once the first is done (both would claim the
    one capture stream and torch's default generator)."""
    inside, overlaps, first_in, release = [], [], threading.Event(), threading.Event()

    def capture(wait: bool) -> None:
        with capturing():
            overlaps.append(len(inside))
            inside.append(1)
            first_in.set()
            if wait:
                release.wait(30)  # only for a broken lock to fail instead of hanging; no verdict depends on it
            inside.pop()

    first = threading.Thread(target=capture, args=(True,))
    first.start()
    first_in.wait(30)
    second = threading.Thread(target=capture, args=(False,))
    second.start()
    second.join(0.5)  # a broken lock lets it in meanwhile
    release.set()
    first.join()
    second.join()
    assert overlaps == [0, 0]
