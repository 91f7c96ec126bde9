"""The OpenAI-compatible HTTP API (`/v1`), served beside the UI by the same process and port.

Scripts and other apps speak this protocol (Ollama, LM Studio, vLLM and TensorRT-LLM's server all
offer it). This module only translates: requests go to the studio service (`pipeline.service`), the
one place their rules live, so API and UI users get the same checks and share the GPU's batch
fairly. A request with an `image_url` part, or for the `minigpt4` model, goes to image chat. A
client is its `user` field: each user has the service's limit of replies in flight (429 past it);
a request without one stands alone. Errors come in OpenAI's shape with the right status and the parameter named; a
client that disconnects mid-stream cancels its generation at the engine's next step.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import queue
import secrets
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, refused_field
from pipeline.errors import UserError
from pipeline.llm.language_model import TokenLogprob
from pipeline.llm.structure import Structure
from pipeline.llm.tool_calls import ToolCall
from pipeline.service.studio import CHAT, IMAGE_CHAT, Busy, ChatTurn, StudioService, Update

IMAGE_MODEL = "minigpt4"
MAX_CHOICES = 8  # `n`: a request's choices decode side by side, each a row of the batch
MAX_BODY_BYTES = 32 << 20  # a data-URL image of a 12 MP photo fits; a 200 MB upload does not


class ApiError(Exception):
    """An error in OpenAI's shape: HTTP `status`, a message, its type, and the parameter it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


@dataclasses.dataclass
class ChatRequest:
    """What the HTTP side keeps of a request: the model asked for, the service's checked turn, and how to answer."""

    model: str
    turn: ChatTurn
    stream: bool
    include_usage: bool
    client: str
    one_call: bool = False  # parallel_tool_calls false: at most one tool call
    n: int = 1  # choices

    def choices(self) -> list[tuple[str, ChatTurn]]:
        """(client, turn) of each choice. A seeded request's choice i uses seed + i, so the choices differ
        and the request repeats. Choices after the first run as clients of their own: a request counts
        once against its client's limit of replies in flight."""
        out = []
        for i in range(self.n):
            seed = self.turn.params.seed
            params = dataclasses.replace(self.turn.params, seed=None if seed is None else (seed + i) % 2**63)
            out.append((self.client if i == 0 else f"{self.client}#choice{i}",
                        dataclasses.replace(self.turn, params=params)))
        return out


def _whole(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ApiError(400, f"{name} must be a whole number from {lo} to {hi}, got {value!r}", name)
    return value


def _image_bytes(url: object, allow_files: bool) -> bytes:
    """The bytes behind an `image_url`: a base64 data URL, or a local file URL where allowed."""
    if not isinstance(url, str):
        raise ApiError(400, "image_url.url must be a string (a data: URL)", "messages")
    if url.startswith("data:"):
        header, _, data = url.partition(",")
        if ";base64" not in header or not data:
            raise ApiError(400, "image_url must be a base64 data URL (data:image/png;base64,...)", "messages")
        try:
            return base64.b64decode(data, validate=True)
        except ValueError:
            raise ApiError(400, "image_url's data URL is not valid base64", "messages") from None
    if url.startswith("file://"):
        if not allow_files:
            raise ApiError(400, "file:// image URLs are off: start the app with --allow-file-urls, or send a "
                                "data: URL", "messages")
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))
        if not path.is_file():
            raise ApiError(400, f"image file {path} does not exist", "messages")
        return path.read_bytes()
    raise ApiError(400, "image_url must be a data: URL (this server fetches nothing from the network)", "messages")


def _messages(raw: object, allow_files: bool) -> tuple[object, bytes | None]:
    """The messages with image parts taken out (their text parts stay for the service to check), and
    the image's bytes."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    messages, image = [], None
    for i, m in enumerate(raw):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image_url" and m.get("role") == "user":
                    image = _image_bytes((part.get("image_url") or {}).get("url"), allow_files)
                elif kind != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}] has a content part this server does not take: "
                                        f"{str(part)[:80]}", "messages")
            m = {**m, "content": [p for p in content if p.get("type") == "text"]}
        if isinstance(m, dict) and m.get("role") == "developer":  # OpenAI's newer name for the system role
            m = {**m, "role": "system"}
        messages.append(m)
    return messages, image


def _logprobs_wanted(body: dict, completion: bool) -> int | None:
    """How many alternatives per token the request asks for, or None for no log-probabilities."""
    if completion:
        return _whole(body, "logprobs", None, 0, 20)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, f"logprobs must be true or false, got {wanted!r:.40}", "logprobs")
    top = _whole(body, "top_logprobs", None, 0, 20)
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def parse_request(body: object, allow_files: bool, service: StudioService, completion: bool = False) -> ChatRequest:
    """A chat-completions request (a completions one with `completion`) checked by the service, or
    `ApiError` naming what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if refused := refused_field(body, COMPLETION_FIELDS if completion else CHAT_FIELDS):
        raise ApiError(400, refused[1], refused[0])
    model = body.get("model")
    if not isinstance(model, str) or not (model == IMAGE_MODEL and not completion or service.serves(model)):
        models = [*service.chat_models(), *([] if completion else [IMAGE_MODEL])]
        raise ApiError(404, f"model {model!r} does not exist here: use one of {', '.join(models)}", "model",
                       "model_not_found")
    choices = _whole(body, "n", 1, 1, MAX_CHOICES)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"user must be a string, got {user!r:.40}", "user")
    one_call = body.get("parallel_tool_calls")
    if one_call is not None and not isinstance(one_call, bool):
        raise ApiError(400, f"parallel_tool_calls must be true or false, got {one_call!r:.40}", "parallel_tool_calls")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = {"max_new_tokens": body.get(max_name), "logprobs": _logprobs_wanted(body, completion),
                **{name: body.get(name) for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed",
                                                     "stop", "presence_penalty", "frequency_penalty",
                                                     "logit_bias")}}
    try:  # absent values keep the UI's defaults
        structure = Structure.from_openai(body.get("tools"), body.get("tool_choice"), body.get("response_format"))
        if completion:
            turn = service.completion_turn(body.get("prompt"), sampling, model=model)
        else:
            messages, image = _messages(body.get("messages"), allow_files)
            mask = _image_bytes(body["mask"], allow_files) if body.get("mask") is not None else None
            turn = service.chat_turn(messages, sampling, tool=IMAGE_CHAT if model == IMAGE_MODEL or image else CHAT,
                                     image=image, mask=mask, model=model, structure=structure)
    except UserError as e:
        param = {"max_new_tokens": max_name, "image": "messages", None: None}.get(e.param, e.param)
        raise ApiError(400, str(e).replace("max_new_tokens", max_name), param) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    # A client is its `user`: requests without one stand alone (scripts and apps on this machine all
    # share one address, and one's 8 parallel requests must not refuse another's).
    return ChatRequest(IMAGE_MODEL if turn.tool == IMAGE_CHAT else model, turn, stream,
                       bool(isinstance(options, dict) and options.get("include_usage")),
                       f"api:user:{user}" if user else f"api:request:{secrets.token_hex(8)}", one_call is False, choices)


class Reply:
    """One choice of a request produced on a worker thread; the HTTP side reads `pieces` and can cancel."""

    def __init__(self, service: StudioService, req: ChatRequest, client: str, turn: ChatTurn):
        self.req, self.cancel = req, threading.Event()
        self.pieces: queue.SimpleQueue = queue.SimpleQueue()  # Update, then ("end", None or exception)
        self.stats = None
        self.calls = 0
        self.ended = False  # the HTTP side has read its end
        threading.Thread(target=self._run, args=(service, client, turn), daemon=True, name="openai-reply").start()

    def _run(self, service: StudioService, client: str, turn: ChatTurn) -> None:
        try:
            for update in service.reply(client, turn, self.cancel):
                if self.req.one_call:
                    update.tool_calls = update.tool_calls[:max(1 - self.calls, 0)]
                self.calls += len(update.tool_calls)
                if update.text or update.tool_calls or update.logprobs:
                    self.pieces.put(update)
                if update.stats is not None:
                    self.stats = update.stats
            self.pieces.put(("end", None))
        except BaseException as e:  # noqa: BLE001 - handed to the HTTP side
            self.pieces.put(("end", e))

    def finish_reason(self) -> str:
        """OpenAI's words: "stop" for an end token or a stop string (`SamplingParams.stop`), "tool_calls"."""
        if self.stats is not None and self.stats.finish_reason in ("length", "context"):
            return "length"
        return "tool_calls" if self.calls else "stop"


def _usage(replies: list[Reply]) -> dict:
    """OpenAI's usage of a request: its prompt once (as the first choice read it), every choice's tokens."""
    first = replies[0].stats
    prompt = first.prompt_tokens if first else 0
    completion = sum(r.stats.new_tokens for r in replies if r.stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens if first else 0}}


def _user_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Busy):
        return ApiError(429, str(e), code="too_many_requests")
    if isinstance(e, UserError):
        return ApiError(400, str(e), e.param)
    return ApiError(500, f"the server failed: {type(e).__name__}")


async def _next(replies: list[Reply], request: Request) -> tuple[int, object]:
    """(choice, its next piece) from the choices still running; a client that has gone cancels them all
    (they all read as ended, and the choice is -1)."""
    while True:
        for i, reply in enumerate(replies):
            if reply.ended:
                continue
            try:
                item = reply.pieces.get_nowait()
            except queue.Empty:
                continue
            reply.ended = isinstance(item, tuple)
            return i, item
        if await request.is_disconnected():
            for reply in replies:
                reply.cancel.set()
                reply.ended = True
            return -1, ("end", None)
        await asyncio.sleep(0.005)


def build_router(service: StudioService, api_key: str | None, allow_files: bool) -> APIRouter:
    """`/v1/models`, `/v1/chat/completions` and `/v1/completions`; `api_key` None: no key asked for (loopback only)."""
    router = APIRouter(prefix="/v1")

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise ApiError(401, "a valid API key is required: send Authorization: Bearer KEY", code="invalid_api_key")

    @router.get("/models")
    async def list_models(request: Request):
        try:
            check_key(request)
        except ApiError as e:
            return e.response()
        now = int(time.time())
        return {"object": "list", "data": [{"id": m, "object": "model", "created": now, "owned_by": "ai-studio"}
                                           for m in [*service.chat_models(), IMAGE_MODEL]]}

    async def answer(request: Request, completion: bool):
        try:
            check_key(request)
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request is {len(raw) >> 20} MiB; the limit is {MAX_BODY_BYTES >> 20} MiB")
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise ApiError(400, f"the body is not valid JSON: {e}") from None
            req = parse_request(body, allow_files, service, completion)
        except (ApiError, UserError) as e:
            return _user_error(e).response()
        replies = [Reply(service, req, client, turn) for client, turn in req.choices()]
        shapes = _shapes(CompletionShape if completion else ChatShape, req.n)
        if req.stream:
            return StreamingResponse(_sse(replies, request, shapes), media_type="text/event-stream")
        updates: list[list[Update]] = [[] for _ in replies]
        while not all(r.ended for r in replies):
            i, item = await _next(replies, request)
            if isinstance(item, tuple):
                if item[1] is not None:
                    for reply in replies:
                        reply.cancel.set()
                    return _user_error(item[1]).response()
                continue
            updates[i].append(item)
        return {**shapes[0].head(req.model), "usage": _usage(replies),
                "choices": [s.whole(u, r.finish_reason()) for s, u, r in zip(shapes, updates, replies)]}

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, completion=False)

    @router.post("/completions")
    async def completions(request: Request):
        return await answer(request, completion=True)

    return router


def _spelled(token: bytes) -> str:
    """A token as OpenAI shows it: its text, with bytes of an unfinished character escaped."""
    return token.decode("utf-8", errors="backslashreplace")


def _shapes(kind: type, n: int) -> list:
    """One shape per choice, all with the request's one id and time."""
    ident, created = f"{kind.PREFIX}-{secrets.token_hex(12)}", int(time.time())
    return [kind(i, ident, created) for i in range(n)]


class ChatShape:
    """Chat completions' JSON for choice `index`: a message with content and tool calls; logprobs as
    `content` entries."""

    PREFIX = "chatcmpl"

    def __init__(self, index: int, ident: str, created: int):
        self.index, self.ident, self.created, self.calls = index, ident, created, 0

    def head(self, model: str, chunk: bool = False) -> dict:
        return {"id": self.ident, "object": "chat.completion.chunk" if chunk else "chat.completion",
                "created": self.created, "model": model}

    @staticmethod
    def _logprobs(entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        return {"content": [{"token": _spelled(t.token), "logprob": t.logprob, "bytes": list(t.token),
                             "top_logprobs": [{"token": _spelled(b), "logprob": v, "bytes": list(b)} for b, v in t.top]}
                            for t in entries], "refusal": None}

    def _calls(self, calls: list[ToolCall]) -> list[dict]:
        out = []
        for call in calls:
            out.append({"index": self.calls, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}})
            self.calls += 1
        return out

    def first(self) -> dict | None:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, update: Update) -> dict:
        delta = {"content": update.text} if update.text else {}
        if update.tool_calls:
            delta["tool_calls"] = self._calls(update.tool_calls)
        return {"index": self.index, "delta": delta, "logprobs": self._logprobs(update.logprobs), "finish_reason": None}

    def last(self, finish: str) -> dict:
        return {"index": self.index, "delta": {}, "logprobs": None, "finish_reason": finish}

    def whole(self, updates: list[Update], finish: str) -> dict:
        text = "".join(u.text for u in updates)
        calls = self._calls([c for u in updates for c in u.tool_calls])
        entries = [e for u in updates for e in u.logprobs or []] if any(u.logprobs is not None for u in updates) \
            else None
        message = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return {"index": self.index, "message": message, "logprobs": self._logprobs(entries), "finish_reason": finish}


class CompletionShape:
    """Completions' JSON for choice `index`: `text`; logprobs as parallel lists of tokens,
    log-probabilities and offsets."""

    PREFIX = "cmpl"

    def __init__(self, index: int, ident: str, created: int):
        self.index, self.ident, self.created, self.offset = index, ident, created, 0

    def head(self, model: str, chunk: bool = False) -> dict:
        return {"id": self.ident, "object": "text_completion", "created": self.created, "model": model}

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        offsets = []
        for t in entries:
            offsets.append(self.offset)
            self.offset += len(_spelled(t.token))
        return {"tokens": [_spelled(t.token) for t in entries], "token_logprobs": [t.logprob for t in entries],
                "top_logprobs": [{_spelled(b): v for b, v in t.top} for t in entries], "text_offset": offsets}

    def first(self) -> dict | None:
        return None

    def delta(self, update: Update) -> dict:
        return {"index": self.index, "text": update.text, "logprobs": self._logprobs(update.logprobs),
                "finish_reason": None}

    def last(self, finish: str) -> dict:
        return {"index": self.index, "text": "", "logprobs": None, "finish_reason": finish}

    def whole(self, updates: list[Update], finish: str) -> dict:
        entries = [e for u in updates for e in u.logprobs or []] if any(u.logprobs is not None for u in updates) \
            else None
        return {"index": self.index, "text": "".join(u.text for u in updates), "logprobs": self._logprobs(entries),
                "finish_reason": finish}


async def _sse(replies: list[Reply], request: Request, shapes: list) -> AsyncIterator[str]:
    """Server-sent events: each choice's role chunk, then the choices' deltas as they come, each
    choice's finish as it ends, usage (if asked) and [DONE]."""
    def chunk(choice: dict | None, **extra) -> str:
        body = {**shapes[0].head(replies[0].req.model, chunk=True), "choices": [choice] if choice else [], **extra}
        return f"data: {json.dumps(body)}\n\n"

    try:
        for shape in shapes:
            if (first := shape.first()) is not None:
                yield chunk(first)
        while not all(r.ended for r in replies):
            i, item = await _next(replies, request)
            if i < 0:
                return
            if isinstance(item, tuple):
                if item[1] is not None:
                    error = _user_error(item[1])
                    yield f"data: {json.dumps({'error': {'message': error.message, 'type': 'server_error'}})}\n\n"
                    return
                yield chunk(shapes[i].last(replies[i].finish_reason()))
                continue
            yield chunk(shapes[i].delta(item))
        if replies[0].req.include_usage:
            yield chunk(None, usage=_usage(replies))
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): the engine drops the requests
        for reply in replies:
            reply.cancel.set()


def mount(app: FastAPI, service: StudioService, api_key: str | None, allow_files: bool) -> None:
    app.include_router(build_router(service, api_key, allow_files))
