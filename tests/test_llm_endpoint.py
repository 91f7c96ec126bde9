"""`--llm-endpoint`: a second app chats through the first one's OpenAI-compatible API, and its Stop
ends the generation on the first."""

import json
import time

import pytest
from gradio_client import Client

from conftest import launched


def engine(url: str) -> dict:
    return json.loads(Client(url, verbose=False).predict(api_name="/engine_status"))["chat"]


@pytest.fixture(scope="module")
def second_app(running_app, tmp_path_factory):
    first = running_app.url
    with launched(tmp_path_factory.mktemp("second") / "launch.log", tmp_path_factory.mktemp("cache2"),
                  "--llm-endpoint", first + "v1", "--context", "2048") as app:
        yield app


def chat_args(message: str, max_new_tokens: int, seed: int, temperature: float = 1.5):
    """/chat's inputs; top-p 1 and top-k off, so the demo's random weights take long to pick the end token."""
    return (message, [], "You are a helpful assistant.", temperature, 1.0, 0, 1.0, max_new_tokens, seed)


def test_the_second_app_streams_replies_from_the_first(running_app, second_app):
    first, second = running_app[0], second_app[0]
    assert "remote" in engine(second)["remote"] or engine(second)["remote"].startswith("http")
    before = engine(first)["decode_steps"]
    job = Client(second, verbose=False).submit(*chat_args("Hello from the second app", 24, 3, 0.0), api_name="/chat")
    updates = list(job)
    _, history, status = updates[-1]
    first_text = updates[0][1][-1]["content"]
    assert len(updates) >= 2 and len(first_text) < len(history[-1]["content"])  # streamed, not one block
    assert history[-1]["role"] == "assistant" and history[-1]["content"]
    assert "tokens" in status and "ended: " in status
    assert engine(first)["decode_steps"] > before  # the first app did the generating
    assert engine(second)["finished"] >= 1 and engine(second)["running"] == 0


def test_stop_in_the_second_app_ends_the_generation_in_the_first(running_app, second_app):
    first, second = running_app[0], second_app[0]
    client = Client(second, verbose=False)

    def natural_length(seed: int) -> int:
        start = engine(first)["decode_steps"]
        client.predict(*chat_args("Write a long essay", 4000, seed), api_name="/chat")
        return engine(first)["decode_steps"] - start

    # the random demo weights pick the end token at some point; take the seed that runs longest
    natural, seed = max((natural_length(seed), seed) for seed in range(20, 28))
    assert natural > 300
    start = engine(first)["decode_steps"]
    job = client.submit(*chat_args("Write a long essay", 4000, seed), api_name="/chat")
    deadline = time.time() + 60
    while engine(first)["decode_steps"] - start < 10 and time.time() < deadline:
        time.sleep(0.02)
    client.predict(api_name="/stop")
    stopped_at = engine(first)["decode_steps"]
    job.result()
    deadline = time.time() + 30
    while engine(first)["running"] and time.time() < deadline:
        time.sleep(0.05)
    end = engine(first)["decode_steps"]
    assert engine(first)["running"] == 0
    # the first app stopped within a few steps of the Stop, well before the reply's natural end
    assert end - stopped_at < 60 and end - start < natural, (natural, start, stopped_at, end)


def test_an_unreachable_endpoint_is_one_line_at_start_up(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    done = subprocess.run([sys.executable, "launch.py", "--llm-endpoint", "http://127.0.0.1:9/v1", "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "STUDIO_CACHE": str(tmp_path)})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cannot reach the chat server at http://127.0.0.1:9/v1" in done.stderr
