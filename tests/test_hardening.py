"""Hardening, tried as a new user and an attacker would: each test failed before its fix."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError

from conftest import ROOT, TEST_MODEL, free_port
from pipeline.llm.text.prompt import chat_format, fit_prompt
from pipeline.llm.text.tokenizer import load_tokenizer
from pipeline.pipelines.chat import ChatPipeline
from pipeline.service.requests import STOPPED
from pipeline.service.studio import StudioService
from pipeline.service.tools import ToolHost, ToolSpec
from studio.backends import load_language_model

PARAMS = ("You are a helpful assistant.", 0.0, 0.8, 20, 1.0)


@pytest.fixture(scope="module")
def client(running_app):
    return Client(running_app[0], verbose=False)


def test_chat_api_takes_plain_text_history(client):
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]
    _, out, status = client.predict("And now?", history, *PARAMS, 4, -1, api_name="/chat")
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant"] and "tok/s" in status


@pytest.mark.parametrize("position, value, name", [
    (5, "many", "top_k"), (3, "hot", "temperature"), (7, 2.5, "max_new_tokens"), (1, "notalist", "history"),
    (1, ["x"], "history[0]"), (2, 42, "system_prompt"),
])
def test_wrong_type_values_name_the_parameter(client, position, value, name):
    args = ["hi", [], *PARAMS, 4, -1]
    args[position] = value
    with pytest.raises(AppError) as caught:
        client.predict(*args, api_name="/chat")
    assert name in str(caught.value), str(caught.value)


def test_a_huge_history_is_refused_at_once(client):
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(10000)]
    with pytest.raises(AppError, match="the limit is 2000"):
        client.predict("hi", history, *PARAMS, 4, -1, api_name="/chat")


def test_prompt_fitting_renders_a_long_history_a_few_times_not_once_per_turn(qwen2_demo):
    fmt = chat_format(load_tokenizer(qwen2_demo))
    renders = []
    render = fmt.render
    fmt.render = lambda messages, tools=(): renders.append(len(messages)) or render(messages, tools)
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 3} for i in range(1999)]
    prompt, notices = fit_prompt(fmt, history, budget=300)
    assert len(prompt) <= 300 and "oldest" in notices[0]
    assert len(renders) <= 15, len(renders)
    # and it keeps as much as fits: one more user turn would not
    kept = renders[-1]
    assert len(render(history[-(kept + 2):])) > 300


def running_replies(client: Client) -> int:
    return json.loads(client.predict(api_name="/engine_status"))["chat"]["running"]


def test_a_session_cannot_queue_more_than_its_limit_of_replies(running_app):
    """The service's per-client limit (`MAX_IN_FLIGHT`): the fifth reply of one browser session is
    refused while four run; Stop then ends the four (endless: greedy, 1500 tokens)."""
    from pipeline.service.studio import MAX_IN_FLIGHT

    client = Client(running_app[0], verbose=False)
    jobs = [client.submit("Write a long essay", [], "", 0, 1.0, 0, 1.0, 1500, -1, api_name="/chat")
            for i in range(MAX_IN_FLIGHT + 1)]
    deadline = time.time() + 120
    # Stop once the four are in the engine (Stop ends the replies that run: pressed as soon as the fifth was
    # refused, it could come before the four had started, which then ran to their end)
    while running_replies(client) < MAX_IN_FLIGHT and time.time() < deadline:
        time.sleep(0.05)
    client.predict(api_name="/stop")
    errors, stopped = [], 0
    for job in jobs:
        try:
            stopped += "Stopped" in job.result(timeout=60)[2]
        except AppError as e:
            errors.append(str(e))
    assert len(errors) == 1 and f"already has {MAX_IN_FLIGHT} replies in progress" in errors[0], errors
    assert stopped == MAX_IN_FLIGHT


def test_stop_while_the_tool_is_still_loading_stops_the_reply(qwen2_demo):
    """Stop pressed while the tool is still loading (its own host: a load held until the test lets it
    go, so it is loading for sure) is not lost: once loaded, the reply ends at once, cancelled, with
    no text; greedy and 300 tokens long, it would otherwise run on to its own end."""
    release = threading.Event()

    def load(say, free):
        assert release.wait(60), "the test never let the load finish"
        return ChatPipeline(load_language_model(qwen2_demo, "demo/qwen2-tiny"), is_demo=True)

    host = ToolHost(torch.device("cpu"), None, lambda line: None)
    host.add(ToolSpec("chat", load, estimate=0))
    service = StudioService(host)
    turn = service.chat_turn([{"role": "user", "content": "Write a long essay"}],
                             dict(max_new_tokens=300, temperature=0, repetition_penalty=1.0))
    updates = service.reply("me", turn)
    try:
        assert next(updates).status.startswith("Loading chat")
        assert next(updates).status == "Loading chat: loading chat…"  # the load runs, held by `release`
        assert host.loaded("chat") is None
        assert service.stop("me", "chat") == 1, "Stop found no reply to stop while the tool was loading"
        release.set()
        rest = list(updates)
    finally:
        release.set()
        updates.close()
    assert host.loaded("chat") is not None
    stats = rest[-1].stats
    assert stats is not None and stats.finish_reason == "cancelled", [u.status for u in rest]
    assert rest[-1].status.startswith(STOPPED) and "".join(u.text for u in rest) == ""
    host.close()


def test_auth_without_a_password_is_refused(tmp_path):
    done = subprocess.run([sys.executable, "launch.py", "--auth", "user:"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "STUDIO_CACHE": str(tmp_path)})
    assert done.returncode == 2 and "--auth must look like user:password, both non-empty" in done.stderr


class _Hostile:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/studio-pwned",))


@pytest.mark.parametrize("damage", ["pickle", "template"])
def test_a_hostile_model_folder_ends_start_up_in_one_line(tmp_path, qwen2_demo, studio_cache, damage):
    folder = tmp_path / "model"
    shutil.copytree(qwen2_demo, folder)
    if damage == "pickle":
        (folder / "model.safetensors").unlink()
        torch.save({"model.embed_tokens.weight": _Hostile()}, folder / "pytorch_model.bin")
        expected = "holds Python objects"
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for %}"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        expected = "chat template"
    done = subprocess.run([sys.executable, "launch.py", "--weights", str(folder), "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "STUDIO_CACHE": str(studio_cache)})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert expected in done.stderr and not os.path.exists("/tmp/studio-pwned")


def test_user_errors_leave_no_traceback_in_the_server_log(running_app, client):
    with pytest.raises(AppError):
        client.predict("", [], *PARAMS, 4, -1, api_name="/chat")
    time.sleep(0.5)
    assert "Traceback" not in running_app[1].read_text()


def test_uploads_over_the_limit_are_refused_and_files_are_deleted_after_keep_files(tmp_path, studio_cache,
                                                                                   monkeypatch):
    """`--max-upload 1mb --keep-files 2`: a 3 MB upload is refused; a mask PNG made for a download and the
    upload it came from are gone a few seconds later (gradio's own sweep, `delete_cache`)."""
    import numpy as np
    from PIL import Image

    from conftest import launched

    big = tmp_path / "big.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (1100, 1100, 3), dtype=np.uint8)).save(big)
    assert big.stat().st_size > 3 << 20
    gradio_files = tmp_path / "gradio"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(gradio_files))  # this app's files only
    with launched(tmp_path / "launch.log", studio_cache, "--context", "2048", "--max-upload", "1mb",
                  "--keep-files", "2") as (url, _, *_):
        client = Client(url, verbose=False)
        from gradio_client import handle_file

        with pytest.raises(Exception, match="(?i)too large|exceeds|413"):
            client.predict(handle_file(str(big)), "[[10, 10, 1]]", "", True, api_name="/segment")
        photo = tmp_path / "my_photo.png"  # not one of the app's examples, which stay cached
        Image.fromarray(np.random.default_rng(1).integers(0, 255, (60, 80, 3), dtype=np.uint8)).save(photo)
        client.predict(handle_file(str(photo)), "[[10, 10, 1]]", "", True, api_name="/segment")
        # the mask was made as the request ended; the upload may be gone already (the request can outlast
        # --keep-files on a slow machine), so it is looked for by name at the end, not here
        made = [p for p in gradio_files.rglob("*.png") if p.name.startswith("mask-")]
        assert made, sorted(gradio_files.rglob("*"))

        def left() -> list[Path]:
            return [p for p in made if p.exists()] + list(gradio_files.rglob("my_photo*"))

        deadline = time.time() + 20
        while left() and time.time() < deadline:
            time.sleep(0.5)
            client.predict(handle_file(str(ROOT / "assets/examples/shapes.jpg")), "[[12, 12, 1]]", "", True,
                           api_name="/segment")  # each new file sweeps the expired ones
        assert not left(), left()


def test_a_long_history_streams_in_a_bounded_number_of_updates(client):
    """Every update resends the whole history, so updates are paced (≤ 20 a second), not one per token."""
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i}"} for i in range(1000)]
    job = client.submit("Write a long essay", history, "", 1.5, 1.0, 0, 1.0, 300, 20, api_name="/chat")
    updates = list(job)
    status = updates[-1][2].split(" · ", 1)[1] if "outgrew" in updates[-1][2] else updates[-1][2]
    tokens = int(status.split(" tokens")[0])
    seconds = tokens / max(float(status.split(" tok/s")[0].split("· ")[-1]), 1e-3)
    assert tokens > 50, status
    assert len(updates) <= seconds / 0.05 + 5 < tokens, (len(updates), seconds, tokens)


def in_process_app(argv: list[str], monkeypatch, cache):
    """The app's server (`app.server`) in this process (tools declared, none loaded), for what a
    subprocess hides: (the server module, args, service)."""
    from app import server
    from studio import compose
    from studio.config import parse_config
    from studio.plan import make_plan

    monkeypatch.setenv("STUDIO_CACHE", str(cache))
    args = parse_config(["--port", str(free_port()), "--model", TEST_MODEL, *argv])
    return server, args, compose.build(args, make_plan(args), out=None)


def test_sessions_are_capped_and_idle_ones_are_dropped(monkeypatch, studio_cache):
    """Gradio keeps ~180 KB per session hash ever seen, up to 10,000: fresh clients fill 1.8 GB. The app
    keeps at most --max-sessions and drops idle ones."""
    from app.sessions import forget_idle_sessions

    server, args, service = in_process_app(["--max-sessions", "5"], monkeypatch, studio_cache)
    app, url = server.start_server(args, service)
    try:
        for _ in range(12):  # each client is a new session
            assert "tools" in json.loads(Client(url, verbose=False).predict(api_name="/engine_status"))
        assert 1 <= len(app.state_holder.session_data) <= 5
        kept = Client(url, verbose=False)
        kept.predict(api_name="/engine_status")
        assert forget_idle_sessions(app, 3600) == 0  # none idle for an hour
        assert forget_idle_sessions(app, 0) >= 1 and len(app.state_holder.session_data) == 0
        assert "tools" in json.loads(kept.predict(api_name="/engine_status"))  # a dropped session comes back
    finally:
        app.close()


@pytest.mark.parametrize("flag, opened", [([], True), (["--no-browser"], False)])
def test_the_browser_opens_on_the_app_from_a_terminal(monkeypatch, studio_cache, capsys, flag, opened):
    """Run from a terminal, serve opens the browser on its URL (not with --no-browser), and Ctrl+C ends it
    with exit status 0 and no traceback."""
    import webbrowser

    server, args, service = in_process_app(flag, monkeypatch, studio_cache)
    urls: list[str] = []
    monkeypatch.setattr(webbrowser, "open", urls.append)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    real_sleep = time.sleep

    def sleep_then_ctrl_c(seconds):  # the serving loop's wait ends in Ctrl+C; other sleeps are left alone
        real_sleep(seconds)
        if sys._getframe(1).f_code.co_name == "serve":
            raise KeyboardInterrupt

    monkeypatch.setattr(server.time, "sleep", sleep_then_ctrl_c)
    assert server.serve(args, service) == 0
    out = capsys.readouterr().out
    assert "[studio] ready: http://127.0.0.1:" in out and "shutting down" in out
    assert urls == ([f"http://127.0.0.1:{args.port}/"] if opened else [])
