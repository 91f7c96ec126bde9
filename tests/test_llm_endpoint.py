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
    assert "tokens" in status and "cut at the token limit" in status  # the remote server's "length", in words
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


def test_tools_json_schemas_logprobs_and_completions_pass_through(running_app, second_app):
    """Through the second app, the first one (the endpoint) applies tools, `json_schema`, logprobs,
    logit_bias and plain completions: the same seeded requests give the same answers either way."""
    import openai

    first, second = (openai.OpenAI(base_url=url + "v1", api_key="-", max_retries=0, timeout=120)
                     for url in (running_app.url, second_app.url))
    model = second.models.list().data[0].id
    sampled = dict(model=model, temperature=1.0, top_p=1.0, seed=3, extra_body={"top_k": 0, "repetition_penalty": 1.0})
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}}]
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}}
    question = [{"role": "user", "content": "Weather?"}]
    answers = []
    for client in (first, second):
        called = client.chat.completions.create(**sampled, messages=question, tools=tools, tool_choice="required",
                                                max_tokens=120).choices[0]
        shaped = client.chat.completions.create(**sampled, messages=question, response_format=schema, max_tokens=60,
                                                logprobs=True, top_logprobs=2).choices[0]
        plain = client.completions.create(model=model, prompt="Once", max_tokens=8, seed=4).choices[0]
        biased = client.completions.create(model=model, prompt="Once", max_tokens=4, seed=4,
                                           logit_bias={"300": 100}).choices[0]
        answers.append((called.finish_reason, [(c.function.name, c.function.arguments) for c in called.message.tool_calls],
                        shaped.message.content, [t.token for t in shaped.logprobs.content], plain.text, biased.text))
    assert answers[0] == answers[1]
    assert answers[0][0] == "tool_calls" and json.loads(answers[0][2])["n"] is not None
    forced = answers[0][5]
    assert forced and forced == forced[:len(forced) // 4] * 4  # token 300, four times
