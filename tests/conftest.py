import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Conversations the tests' apps keep go to a temporary folder, never the user's data folder.
os.environ.setdefault("STUDIO_DATA", tempfile.mkdtemp(prefix="studio-test-data-"))
sys.path.insert(0, str(ROOT))

from pipeline.llm.demo import demo_model_dir  # noqa: E402


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "browser: drives a real browser; run alone, not beside another test worker")


@pytest.fixture(scope="session")
def studio_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("studio-cache")


@pytest.fixture(scope="session")
def qwen_v1_demo(studio_cache) -> Path:
    return demo_model_dir("demo/qwen-v1-tiny", studio_cache)


@pytest.fixture(scope="session")
def qwen2_demo(studio_cache) -> Path:
    return demo_model_dir("demo/qwen2-tiny", studio_cache)


@pytest.fixture(scope="session")
def llama_demo(studio_cache) -> Path:
    return demo_model_dir("demo/llama-tiny", studio_cache)


def train_sentencepiece(folder: Path) -> Path:
    """A BPE `tokenizer.model` with byte fallback trained here on the demo corpus, set up as LLaMA's own is
    (identity normalisation, no whitespace folding; <unk>, <s>, </s> at 0, 1, 2)."""
    import sentencepiece

    from pipeline.llm.demo import CORPUS

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.read_text().splitlines()), model_prefix=str(folder / "tokenizer"),
        vocab_size=600, model_type="bpe", byte_fallback=True, character_coverage=0.9995, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2)
    return folder / "tokenizer.model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class App(NamedTuple):
    url: str
    log: Path
    port: int
    process: subprocess.Popen


# What the tests' apps chat with unless a test names a model: the tiny random-weight demo, whose replies
# are instant on any CPU. `model=None` starts the app as users do, with no --model (the real SmolLM2).
TEST_MODEL = "demo/qwen-v1-tiny"


@contextlib.contextmanager
def launched(log: Path, cache: Path, *args: str, model: str | None = TEST_MODEL):
    """`launch.py ARGS` in a subprocess on a free port with `cache` as its cache: yields App(url, log,
    port, process) once it serves; stopped on exit (if still running)."""
    if model is not None and not {"--model", "--weights", "--llm-endpoint"} & set(args):
        args = ("--model", model, *args)
    port = free_port()
    env = {**os.environ, "STUDIO_CACHE": str(cache), "STUDIO_DATA": str(cache / "data"),
           "GRADIO_ANALYTICS_ENABLED": "False"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "launch.py", "--port", str(port), *args],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while f"127.0.0.1:{port}" not in log.read_text() and f"localhost:{port}" not in log.read_text():  # --host 0.0.0.0
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"launch.py did not come up:\n{log.read_text()}")
        time.sleep(0.5)
    try:
        yield App(f"http://127.0.0.1:{port}/", log, port, proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def running_app(tmp_path_factory):
    """The app on the demo models (`--backend auto`, fresh cache): yields App(url, log, port, process)."""
    with launched(tmp_path_factory.mktemp("app") / "launch.log", tmp_path_factory.mktemp("cache"),
                  "--context", "4096") as app:
        yield app
