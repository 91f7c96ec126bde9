"""`/v1` against input that used to answer 500 or cost the server dearly (issue 40, "Nothing 500"): lone
surrogates, deep nesting, bodies past the limit, `n` up to 8 for an idle client, the completions
overflow message, and sampling defaults that come from the model rather than from the UI."""

import json
import shutil
import socket
import urllib.parse

import httpx
import openai
import pytest

from app.openai_body import MAX_BODY_BYTES, MAX_DEPTH
from conftest import launched

CHAT, QWEN2 = "demo/qwen-v1-tiny", "demo/qwen2-tiny"


@pytest.fixture(scope="module")
def url(running_app) -> str:
    return running_app.url


def post(url: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(url + "v1/" + path, content=body, headers={"content-type": "application/json"}, timeout=120)


def assert_error(answer: httpx.Response, status: int, param: str | None, *words: str) -> None:
    """An error in OpenAI's shape, with `status`, naming `param`, its message holding `words`."""
    error = answer.json()["error"]
    assert answer.status_code == status and set(error) == {"message", "type", "param", "code"}, answer.text
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert all(w in error["message"] for w in words), error


@pytest.mark.parametrize("model, path, fields, param, where", [
    (QWEN2, "chat/completions", '"messages": [{"role": "user", "content": "hi \\ud800 there"}]', "messages",
     "messages[0].content"),
    (CHAT, "chat/completions", '"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]', "stop",
     "stop[0]"),
    (QWEN2, "completions", '"prompt": "hi \\ud800"', "prompt", "prompt")])
def test_a_lone_surrogate_is_a_400_naming_where_it_is(url, model, path, fields, param, where):
    """JSON may escape half of a UTF-16 pair (`"\\ud800"`); it is no character, and the tokenizer failed
    on it with a TypeError (500). Now: a 400 that says where; the server keeps serving."""
    body = f'{{"model": "{model}", "max_tokens": 2, {fields}}}'.encode()
    assert_error(post(url, path, body), 400, param, where, "lone UTF-16 surrogate", "\\ud800")
    ok = post(url, path, body.replace(b"\\ud800", b"\\ud83d\\ude00"))  # a whole pair: one character
    assert ok.status_code == 200, ok.text


def test_a_lone_surrogate_in_a_key_is_a_400_too(url):
    """Not named back as the parameter: the error itself could not be sent as UTF-8."""
    body = b'{"model": "' + CHAT.encode() + b'", "messages": [{"role": "user", "content": "hi"}], "\\udfff": 1}'
    assert_error(post(url, "chat/completions", body), 400, None, "a key of the body", "\\udfff")


def nested_schema(levels: int) -> str:
    """An object schema `levels` objects deep, as JSON text (`json.dumps` itself recurses too deeply)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


def test_deep_nesting_is_a_400_naming_the_nesting(url):
    """A `json_schema` 500 levels deep, and a body of 200,000 nested `[`, raised RecursionError (500).
    Now: 400s saying how deep the body may nest; a schema nested within the limit still works."""
    ask = {"model": QWEN2, "max_tokens": 4, "messages": [{"role": "user", "content": "Go"}]}

    def schema_body(levels: int) -> bytes:
        form = '{"type": "json_schema", "json_schema": {"name": "deep", "schema": %s}}' % nested_schema(levels)
        return (json.dumps(ask)[:-1] + ', "response_format": ' + form + "}").encode()

    assert_error(post(url, "chat/completions", schema_body(500)), 400, None, f"more than {MAX_DEPTH} levels")
    assert_error(post(url, "chat/completions", b"[" * 200_000), 400, None, f"more than {MAX_DEPTH} levels")
    assert_error(post(url, "completions", b'{"prompt": ' + b"[" * 50_000), 400, None, f"more than {MAX_DEPTH}")
    fits = (MAX_DEPTH - 4) // 2 - 1  # the body, response_format, json_schema and schema: 4; each level 2
    assert_error(post(url, "chat/completions", schema_body(fits + 2)), 400, "response_format",
                 f"more than {MAX_DEPTH} levels", "response_format.json_schema.schema.properties")
    assert post(url, "chat/completions", schema_body(fits)).status_code == 200


def raw_request(url: str, head: str, body: bytes) -> tuple[bytes, bytes]:
    """Send `head` and `body` on a socket of its own; the response's (status line, body). The request's
    body is left unfinished, so only a server that stops reading at its limit answers (a server that
    waits for the rest fails the test after 60 s)."""
    where = urllib.parse.urlparse(url)
    with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
        sock.sendall(head.encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
        headers, _, content = answer.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in headers.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(content) < length and (chunk := sock.recv(65536)):
            content += chunk
    return headers.split(b"\r\n")[0], content


def test_a_body_past_the_limit_is_refused_while_it_is_read(url):
    """A chunked body gets its 413 as soon as it passes MAX_BODY_BYTES, though it has not ended (it was
    read whole first: 475 MB more memory for 256 MiB); a Content-Length over the limit gets it before any
    body; a chunked body just over the limit, sent whole, gets it too."""
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    limit = f"the limit is {MAX_BODY_BYTES >> 20} MiB".encode()
    piece = b"x" * (1 << 20)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in [piece] * (MAX_BODY_BYTES >> 20) + [b"x"])
    status, content = raw_request(url, head + "Transfer-Encoding: chunked\r\n\r\n", chunks)  # no last chunk
    assert status.startswith(b"HTTP/1.1 413 ") and limit in content, (status, content)
    status, content = raw_request(url, head + f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n", b"")
    assert status.startswith(b"HTTP/1.1 413 ") and limit in content, (status, content)

    def just_over():
        yield from [piece] * (MAX_BODY_BYTES >> 20)
        yield b"x"

    answer = httpx.post(url + "v1/completions", content=just_over(), timeout=120)
    assert_error(answer, 413, None, "too large", limit.decode())


def test_an_idle_client_gets_up_to_8_choices(url):
    """README promises `n` 1–8, but the per-client limit of 4 replies in flight refused n 5–8 for a
    client with a `user` (429). A client with nothing in flight is served up to 8 at once."""
    client = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=120)
    for n in (5, 8):
        reply = client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], n=n,
                                               max_tokens=2, user="carol")
        assert [c.index for c in reply.choices] == list(range(n))


def test_a_completion_prompt_past_the_context_says_the_real_numbers(url, qwen_v1_demo):
    """The app runs a 4096-token context: with max_tokens 8, 8 positions are kept for the reply, not
    half; the message says the prompt's size, the context's and what is kept."""
    from pipeline.llm.text.tokenizer import load_tokenizer

    prompt = "the cat sat on the mat " * 800
    size = len(load_tokenizer(qwen_v1_demo).encode(prompt))
    assert size > 4096
    client = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=CHAT, prompt=prompt, max_tokens=8)
    assert caught.value.body["param"] == "prompt"
    assert caught.value.body["message"] == (
        f"the prompt is {size} tokens, but this model's context is 4096 tokens and 8 of them are kept for the "
        f"reply (max_tokens): send at most 4088 prompt tokens, or ask for fewer max_tokens")


def test_sampling_defaults_come_from_the_models_generation_config(tmp_path, studio_cache, qwen2_demo):
    """A model folder whose generation_config.json names sampling values: a /v1 request that omits them
    gets them (the same seeded reply as one that sends them), not the UI's defaults or neutral ones."""
    folder = tmp_path / "tuned-qwen2"
    shutil.copytree(qwen2_demo, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    tuned = {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.3}
    (folder / "generation_config.json").write_text(json.dumps({**config, **tuned, "do_sample": True}))
    with launched(tmp_path / "launch.log", studio_cache, "--weights", str(folder), "--context", "1024") as app:
        client = openai.OpenAI(base_url=app.url + "v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        ask = dict(model=model, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=30, seed=3)

        def text(**sampling) -> str:
            return client.chat.completions.create(**ask, **sampling).choices[0].message.content

        sent = text(temperature=0.6, top_p=0.9, extra_body={"top_k": 7, "repetition_penalty": 1.3})
        assert text() == sent
        assert text(temperature=1.0, top_p=1.0, extra_body={"top_k": 0, "repetition_penalty": 1.0}) != sent
        assert text(temperature=0.7, top_p=0.8, extra_body={"top_k": 20, "repetition_penalty": 1.05}) != sent
