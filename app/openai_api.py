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

from app.openai_fields import refused_field
from pipeline.errors import UserError
from pipeline.service.studio import CHAT, IMAGE_CHAT, Busy, ChatTurn, StudioService

IMAGE_MODEL = "minigpt4"
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


def parse_request(body: object, allow_files: bool, service: StudioService) -> ChatRequest:
    """A request checked by the service, or `ApiError` naming what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if refused := refused_field(body):
        raise ApiError(400, refused[1], refused[0])
    model = body.get("model")
    if not isinstance(model, str) or not (model == IMAGE_MODEL or service.serves(model)):
        models = [*service.chat_models(), IMAGE_MODEL]
        raise ApiError(404, f"model {model!r} does not exist here: use one of {', '.join(models)}", "model",
                       "model_not_found")
    if _whole(body, "n", 1, 1, 1) != 1:
        raise ApiError(400, "n must be 1", "n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"user must be a string, got {user!r:.40}", "user")
    messages, image = _messages(body.get("messages"), allow_files)
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mask = _image_bytes(body["mask"], allow_files) if body.get("mask") is not None else None
    sampling = {"max_new_tokens": body.get(max_name),
                **{name: body.get(name) for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed",
                                                     "stop", "presence_penalty", "frequency_penalty")}}
    try:  # absent values keep the UI's defaults
        turn = service.chat_turn(messages, sampling, tool=IMAGE_CHAT if model == IMAGE_MODEL or image else CHAT,
                                 image=image, mask=mask, model=model)
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
                       f"api:user:{user}" if user else f"api:request:{secrets.token_hex(8)}")


class Reply:
    """One request's reply produced on a worker thread; the HTTP side reads `pieces` and can cancel."""

    def __init__(self, service: StudioService, req: ChatRequest):
        self.req, self.cancel = req, threading.Event()
        self.pieces: queue.SimpleQueue = queue.SimpleQueue()  # str, then ("end", stats or exception)
        self.stats = None
        threading.Thread(target=self._run, args=(service,), daemon=True, name="openai-reply").start()

    def _run(self, service: StudioService) -> None:
        try:
            for update in service.reply(self.req.client, self.req.turn, self.cancel):
                if update.text:
                    self.pieces.put(update.text)
                if update.stats is not None:
                    self.stats = update.stats
            self.pieces.put(("end", None))
        except BaseException as e:  # noqa: BLE001 - handed to the HTTP side
            self.pieces.put(("end", e))

    def finish_reason(self) -> str:
        """OpenAI's words: "stop" for an end token or a stop string (`SamplingParams.stop`)."""
        return "length" if self.stats is not None and self.stats.finish_reason in ("length", "context") else "stop"

    def usage(self) -> dict:
        prompt = self.stats.prompt_tokens if self.stats else 0
        completion = self.stats.new_tokens if self.stats else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.stats.cached_tokens if self.stats else 0}}


def _user_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Busy):
        return ApiError(429, str(e), code="too_many_requests")
    if isinstance(e, UserError):
        return ApiError(400, str(e), e.param)
    return ApiError(500, f"the server failed: {type(e).__name__}")


async def _next(reply: Reply, request: Request):
    """The reply's next piece, cancelling it if the client has gone."""
    while True:
        try:
            return reply.pieces.get_nowait()
        except queue.Empty:
            if await request.is_disconnected():
                reply.cancel.set()
                return ("end", None)
            await asyncio.sleep(0.005)


def build_router(service: StudioService, api_key: str | None, allow_files: bool) -> APIRouter:
    """`/v1/models` and `/v1/chat/completions`; `api_key` None: no key asked for (loopback only)."""
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

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        try:
            check_key(request)
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request is {len(raw) >> 20} MiB; the limit is {MAX_BODY_BYTES >> 20} MiB")
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise ApiError(400, f"the body is not valid JSON: {e}") from None
            req = parse_request(body, allow_files, service)
        except (ApiError, UserError) as e:
            return _user_error(e).response()
        reply = Reply(service, req)
        ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if req.stream:
            return StreamingResponse(_sse(reply, request, ident, created), media_type="text/event-stream")
        parts = []
        while True:
            item = await _next(reply, request)
            if isinstance(item, tuple):
                if item[1] is not None:
                    return _user_error(item[1]).response()
                break
            parts.append(item)
        return {"id": ident, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                             "finish_reason": reply.finish_reason()}], "usage": reply.usage()}

    return router


async def _sse(reply: Reply, request: Request, ident: str, created: int) -> AsyncIterator[str]:
    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": reply.req.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(body)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            item = await _next(reply, request)
            if isinstance(item, tuple):
                if item[1] is not None:
                    error = _user_error(item[1])
                    yield f"data: {json.dumps({'error': {'message': error.message, 'type': 'server_error'}})}\n\n"
                    return
                break
            yield chunk({"content": item})
        yield chunk({}, reply.finish_reason())
        if reply.req.include_usage:
            body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": reply.req.model,
                    "choices": [], "usage": reply.usage()}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): the engine drops the request
        reply.cancel.set()


def mount(app: FastAPI, service: StudioService, api_key: str | None, allow_files: bool) -> None:
    app.include_router(build_router(service, api_key, allow_files))
