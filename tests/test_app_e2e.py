"""End to end: `launch.py` in a subprocess on a free port, driven through `gradio_client`."""

import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT

gradio_client = pytest.importorskip("gradio_client")

PARAMS = dict(system_prompt="You are a helpful assistant.", temperature=0.7, top_p=0.9, top_k=40,
              repetition_penalty=1.05, max_new_tokens=24, seed=3)


@pytest.fixture(scope="module")
def app(running_app):
    url, log, port = running_app
    return gradio_client.Client(url, verbose=False), log, port


def text_of(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def stream_chat(client, message: str, history: list) -> list:
    job = client.submit(message, history, *PARAMS.values(), api_name="/chat")
    return list(job)


def test_serves_on_localhost_with_demo_model(app):
    _, log, port = app
    text = log.read_text()
    assert "http://127.0.0.1:" in text and "demo/qwen-v1-tiny" in text
    page = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False).config
    assert "random weights" in str(page) and "meaningless" in str(page)  # the UI says it plainly


def test_one_users_stop_does_not_stop_another_users_reply(app):
    client, _, port = app
    other = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False)  # another browser session
    params = {**PARAMS, "max_new_tokens": 300, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
              "repetition_penalty": 1.3}
    job = client.submit("Tell me everything", [], *params.values(), api_name="/chat")
    while len(job.outputs()) < 2 and not job.done():
        time.sleep(0.05)
    other.predict(api_name="/stop")
    _, history, status = job.result(timeout=120)
    assert "cancelled" not in status and text_of(history[-1])


def test_multi_turn_chat_streams(app):
    client, *_ = app
    updates = stream_chat(client, "Hello! 你好", [])
    assert len(updates) > 2  # streamed: several partial updates before the last
    _, history, status = updates[-1]
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert text_of(history[0]) == "Hello! 你好" and text_of(history[1])
    partial = [text_of(u[1][-1]) for u in updates]
    assert all(partial[-1].startswith(p) for p in partial)  # each update extends the last
    assert "tok/s" in status

    updates = stream_chat(client, "And a follow-up?", history)
    _, history2, _ = updates[-1]
    assert [m["role"] for m in history2] == ["user", "assistant", "user", "assistant"]
    assert text_of(history2[1]) == text_of(history[1]) and text_of(history2[2]) == "And a follow-up?"


@pytest.mark.parametrize("message, overrides, expected", [
    ("", {}, "empty"),
    ("   \n ", {}, "empty"),
    ("hi", {"temperature": 1e9}, "temperature|maximum"),
    ("hi", {"top_p": -4}, "top-p|minimum"),
    ("hi", {"max_new_tokens": 10**7}, "max new tokens|maximum"),
])
def test_bad_requests_get_clear_errors_and_app_keeps_serving(app, message, overrides, expected):
    client, *_ = app
    params = {**PARAMS, **overrides}
    with pytest.raises(Exception) as err:
        client.predict(message, [], *params.values(), api_name="/chat")
    assert any(word in str(err.value) for word in expected.split("|")), str(err.value)
    _, history, _ = client.predict("still there?", [], *PARAMS.values(), api_name="/chat")
    assert text_of(history[0]) == "still there?"


def test_stop_ends_the_reply_and_keeps_the_text(app):
    client, *_ = app
    params = {**PARAMS, "max_new_tokens": 4000, "temperature": 1.0}
    job = client.submit("Write a very long story", [], *params.values(), api_name="/chat")
    deadline = time.time() + 60
    while len(job.outputs()) < 3 and time.time() < deadline:
        time.sleep(0.05)
    client.predict(api_name="/stop")
    deadline = time.time() + 30
    while not job.done() and time.time() < deadline:
        time.sleep(0.1)
    assert job.done(), "the reply did not stop"
    outputs = job.outputs()
    assert outputs and text_of(outputs[-1][1][-1])  # what was said before Stop is kept
    new_tokens = int(outputs[-1][2].split(" tokens")[0]) if "tokens" in outputs[-1][2] else 0
    assert new_tokens < 4000


def test_launch_errors_are_one_line(tmp_path):
    env = {**os.environ, "STUDIO_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    for args, expected in [(["--model", "Qwen/Qwen2.5-0.5B-Instruct"], "could not download"),
                           (["--weights", str(tmp_path / "missing")], "not a folder"),
                           (["--device", "cuda:99"], "--device cuda:99: PyTorch sees"),
                           (["--device", "tpu"], "use auto, cpu, cuda or cuda:N")]:
        proc = subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_check_says_what_would_run(tmp_path):
    env = {**os.environ, "STUDIO_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "launch.py", "--check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    assert "would run" in proc.stdout and "backend torch" in proc.stdout and "weights:" in proc.stdout
    assert not (tmp_path / "demo").exists()  # --check builds and downloads nothing
