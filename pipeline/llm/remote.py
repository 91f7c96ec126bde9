"""Chat through a remote OpenAI-compatible server (`--llm-endpoint`): vLLM, TensorRT-LLM's
`trtllm-serve`, another AI Studio, on a bigger machine or a cluster, while Segment and image chat
stay local.

The remote server applies the chat template and tokenizes, so this works at the level of messages:
`RemoteLanguageModel.chat` has `LanguageModel.chat`'s signature and yields the same `ChatEvent`s,
so the chat pipeline, the UI and the API treat it like a local model. The stream is read as it
arrives, blocking (nothing polls): Stop (the cancel flag) is seen at the server's next chunk and
closes the HTTP stream, which a serving engine takes as a cancelled request; remote errors become
one-line `UserError`s naming the server.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence

import httpx

from pipeline.errors import UserError
from pipeline.llm.engine.seam import ChatEvent, ChatModel, FinishReason, GenerationStats, TokenLogprob
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.structure import Structure
from pipeline.llm.text.tool_calls import ToolCall

CHARS_PER_TOKEN = 4  # an estimate of text per token where the tokenizer is elsewhere
CONNECT_TIMEOUT_S = 10


class RemoteLanguageModel(ChatModel):
    """`LanguageModel`'s chat over HTTP: the server applies the chat template and tokenizes."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model_id = model or self._first_model()
        self.description = f"{self.model_id} on {self.url} (remote)"
        self.sampling_defaults = {}  # not known here: an API request's omitted values are sent neutral
        self.running = self.finished = 0
        self._lock = threading.Lock()

    def status(self) -> dict[str, int | str]:
        """What `/engine_status` shows for a remote model: requests in flight here, replies done."""
        with self._lock:
            return {"remote": self.url, "running": self.running, "finished": self.finished}

    def _count(self, delta: int) -> None:
        with self._lock:
            self.running += delta
            self.finished += delta < 0

    def _first_model(self) -> str:
        try:
            answer = httpx.get(f"{self.url}/models", headers=self.headers, timeout=CONNECT_TIMEOUT_S)
        except httpx.HTTPError as e:
            raise UserError(f"cannot reach the chat server at {self.url} ({type(e).__name__}): is it running, "
                            f"and is the URL its /v1?") from None
        models = _checked(answer, self.url).json().get("data") or []
        if not models:
            raise UserError(f"the chat server at {self.url} lists no models; pass --llm-model NAME")
        return models[0]["id"]

    @property
    def context(self) -> int:
        return 0  # unknown here: the server fits the prompt

    def close(self) -> None:
        """Nothing to free: the model lives on the server."""

    def check_chat(self) -> None:
        """The server applies its own chat template: nothing to check here."""

    @staticmethod
    def count_tokens(text: str) -> int:
        """Its tokenizer is the server's: English runs about 4 characters a token."""
        return len(text) // CHARS_PER_TOKEN + 1

    def chat(self, messages: Sequence[dict], params: SamplingParams, cancel: threading.Event | None = None,
             session: str | None = None, structure: Structure = Structure()) -> Iterator[ChatEvent]:
        """`LanguageModel.chat` over HTTP (the prompt format and `session` are the server's business; tools,
        JSON formats and logprobs are passed on for the server to apply)."""
        return self._generate("chat/completions", {"messages": list(messages)}, params, cancel, structure)

    def complete(self, text: str, params: SamplingParams, cancel: threading.Event | None = None,
                 session: str | None = None, structure: Structure = Structure()) -> Iterator[ChatEvent]:
        """`LanguageModel.complete` over HTTP (the server's `/v1/completions`)."""
        return self._generate("completions", {"prompt": text}, params, cancel, structure)

    def _generate(self, path: str, request: dict, params: SamplingParams, cancel: threading.Event | None,
                  structure: Structure) -> Iterator[ChatEvent]:
        body = {"model": self.model_id, **request, **structure.fields, "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "repetition_penalty": params.repetition_penalty}
        if params.seed is not None:
            body["seed"] = params.seed
        for name in ("presence_penalty", "frequency_penalty"):  # sent only when asked for: the server owns them
            if getattr(params, name):
                body[name] = getattr(params, name)
        if params.stop:
            body["stop"] = list(params.stop)
        if params.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
        if params.logprobs is not None:
            body |= {"logprobs": True, "top_logprobs": params.logprobs} if path == "chat/completions" else \
                {"logprobs": params.logprobs}
        cancel = cancel or threading.Event()
        stats, start = GenerationStats(), time.perf_counter()
        calls: dict[int, dict] = {}  # streamed tool calls by index, put together as their deltas come
        self._count(+1)
        try:  # the stream is read here, blocking: Stop is seen at the server's next chunk, and leaving closes it
            with httpx.Client(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)) as client, \
                    client.stream("POST", f"{self.url}/{path}", json=body, headers=self.headers) as answer:
                if answer.status_code != 200:
                    answer.read()
                    _checked(answer, self.url)
                for kind, value in _pieces(answer, self.url):
                    if cancel.is_set():
                        stats.finish_reason = FinishReason.CANCELLED
                        break
                    if kind in ("text", "logprobs"):
                        if not stats.time_to_first_token_s:
                            stats.time_to_first_token_s = time.perf_counter() - start
                        stats.new_tokens += 1
                        yield ChatEvent(text=value) if kind == "text" else ChatEvent(logprobs=value)
                    elif kind == "call":
                        call = calls.setdefault(value.get("index", 0), {"id": None, "name": "", "arguments": ""})
                        call["id"] = value.get("id") or call["id"]
                        function = value.get("function") or {}
                        call["name"] += function.get("name") or ""
                        call["arguments"] += function.get("arguments") or ""
                    elif kind == "finish":
                        stats.finish_reason = value
                    elif kind == "usage":
                        stats.prompt_tokens, stats.new_tokens = value["prompt_tokens"], value["completion_tokens"]
        except httpx.HTTPError as e:
            raise UserError(f"lost the chat server at {self.url} ({type(e).__name__})") from None
        finally:  # Stop, an error or a caller that stopped listening: the closed stream cancels it remotely
            self._count(-1)
        stats.decode_s = max(time.perf_counter() - start - stats.time_to_first_token_s, 0.0)
        stats.finish_reason = stats.finish_reason or FinishReason.STOP
        yield ChatEvent(stats=stats, tool_calls=[ToolCall(c["name"], c["arguments"], *([c["id"]] if c["id"] else []))
                                                 for _, c in sorted(calls.items())])


def _pieces(answer: httpx.Response, url: str) -> Iterator[tuple[str, object]]:
    """A streamed answer's pieces as they arrive: ("text", str), ("call", a tool call's delta),
    ("logprobs", [TokenLogprob]), ("finish", reason), ("usage", dict)."""
    for line in answer.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError as e:
            raise UserError(f"the chat server at {url} sent something that is not OpenAI's format ({e})") from None
        if "error" in chunk:
            raise UserError(f"the chat server at {url} failed: {chunk['error'].get('message')}")
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or choice.get("text"):
                yield "text", delta.get("content") or choice["text"]
            for call in delta.get("tool_calls") or []:
                yield "call", call
            logprobs = choice.get("logprobs") or {}
            if logprobs.get("content"):  # chat completions' layout
                yield "logprobs", [_token_logprob(e) for e in logprobs["content"]]
            elif logprobs.get("tokens"):  # completions' layout
                tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
                yield "logprobs", [TokenLogprob(t.encode(), v, [(k.encode(), x) for k, x in (top or {}).items()])
                                   for t, v, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops)]
            if choice.get("finish_reason"):
                yield "finish", choice["finish_reason"]
        if chunk.get("usage"):
            yield "usage", chunk["usage"]


def _token_logprob(entry: dict) -> TokenLogprob:
    """One entry of OpenAI's `logprobs.content` as a `TokenLogprob`."""
    def spelled(e: dict) -> bytes:
        return bytes(e["bytes"]) if e.get("bytes") is not None else e["token"].encode()

    return TokenLogprob(spelled(entry), entry["logprob"],
                        [(spelled(t), t["logprob"]) for t in entry.get("top_logprobs") or []])


def _checked(answer: httpx.Response, url: str) -> httpx.Response:
    if answer.status_code == 200:
        return answer
    try:
        message = answer.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = answer.text[:200]
    raise UserError(f"the chat server at {url} answered {answer.status_code}: {message}")
