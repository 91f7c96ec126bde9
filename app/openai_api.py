"""The OpenAI-compatible HTTP API (`/v1`), served beside the UI by the same process and port.

Scripts and other apps speak this protocol (Ollama, LM Studio, vLLM and TensorRT-LLM's server all
offer it). This module only serves: `openai_protocol` turns a request into one call of the studio
service, `openai_shapes` writes the answers. The service's iterator runs on a thread of the request's
own, which pushes each update onto the event loop (`call_soon_threadsafe` into an `asyncio.Queue`):
nothing polls, so many streams cost nothing while they wait. A client that disconnects cancels its
generation at the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.openai_body import read_json
from app.openai_audio import speech, transcription
from app.openai_embeddings import embeddings
from app.openai_protocol import ApiError, ChatRequest, api_error, parse_request
from app.openai_shapes import Response, error_event
from pipeline.errors import UserError
from pipeline.service.requests import Update
from pipeline.service.studio import StudioService

Item = tuple[int, Update]


@dataclasses.dataclass(frozen=True)
class _Ended:
    """The last thing pushed for a request: the error that ended it, if one did."""

    error: BaseException | None


def _pushed(items: Iterator[Item]) -> asyncio.Queue:
    """A queue on the running event loop that a thread of its own fills from `items` as they come,
    then closes with `_Ended`."""
    loop, out = asyncio.get_running_loop(), asyncio.Queue()

    def run() -> None:
        try:
            for item in items:
                loop.call_soon_threadsafe(out.put_nowait, item)
            end = _Ended(None)
        except BaseException as e:  # noqa: BLE001 - answered to the client
            end = _Ended(e)
        loop.call_soon_threadsafe(out.put_nowait, end)

    threading.Thread(target=run, daemon=True, name="openai-request").start()
    return out


async def _cancel_when_gone(request: Request, cancels: list[threading.Event]) -> None:
    """Wait for the client to disconnect (the server says so), then stop every choice."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for cancel in cancels:
        cancel.set()


async def _sse(req: ChatRequest, response: Response, items: asyncio.Queue, first: Item | _Ended,
               cancels: list[threading.Event]) -> AsyncIterator[str]:
    """Server-sent events: each choice's role chunk, then the choices' deltas as they come, each choice's
    finish as it ends, usage (if asked) and [DONE]."""
    try:
        for event in response.opening():
            yield event
        item = first
        while not isinstance(item, _Ended):
            for event in response.events(*item):
                yield event
            item = await items.get()
        if item.error is not None:
            yield error_event(api_error(item.error, req.names).body())
            return
        for event in response.closing(req.include_usage):
            yield event
    finally:  # the client went away (or the stream ended): the engine drops the requests
        for cancel in cancels:
            cancel.set()


async def _answer(service: StudioService, req: ChatRequest,
                  request: Request) -> JSONResponse | StreamingResponse | dict:
    """The response to a checked request: an error if it fails before its first update, else the
    stream, or the whole response once every choice has ended."""
    cancels = [threading.Event() for _ in range(req.n)]
    items = _pushed(req.answer(service, cancels))
    watch = asyncio.create_task(_cancel_when_gone(request, cancels))
    try:
        item = await items.get()
        if isinstance(item, _Ended) and item.error is not None:
            return api_error(item.error, req.names).response()
        response = Response(req.completion, req.model, req.n, req.max_calls)
        if req.stream:
            return StreamingResponse(_sse(req, response, items, item, cancels), media_type="text/event-stream")
        while not isinstance(item, _Ended):
            response.choices[item[0]].take(item[1])
            item = await items.get()
        return api_error(item.error, req.names).response() if item.error is not None else response.whole()
    finally:  # a stream watches its client itself from here on
        watch.cancel()


def build_router(service: StudioService, api_key: str | None, allow_files: bool) -> APIRouter:
    """`/v1/models`, `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `/v1/audio/…`; `api_key` None: no
    key asked for (loopback only)."""
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
                                           for m in [*service.chat_models(), service.image_models()[0]]]}

    async def answer(request: Request, completion: bool) -> JSONResponse | StreamingResponse | dict:
        try:
            check_key(request)
            req = parse_request(await read_json(request), allow_files, service, completion)
        except (ApiError, UserError) as e:
            return api_error(e).response()
        return await _answer(service, req, request)

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, completion=False)

    @router.post("/completions")
    async def completions(request: Request):
        return await answer(request, completion=True)

    async def keyed(request: Request, work: Callable[[], Awaitable]):
        """`work()`'s response once the key is checked, or the error in OpenAI's shape."""
        try:
            check_key(request)
            return await work()
        except (ApiError, UserError) as e:
            return api_error(e).response()

    @router.post("/embeddings")
    async def embeddings_route(request: Request):
        async def work():  # its batches take seconds on a CPU
            return await asyncio.to_thread(embeddings, service, await read_json(request))
        return await keyed(request, work)

    @router.post("/audio/transcriptions")
    async def transcriptions_route(request: Request):
        return await keyed(request, lambda: transcription(service, request))

    @router.post("/audio/speech")
    async def speech_route(request: Request):
        async def work():
            return await speech(service, await read_json(request), request)
        return await keyed(request, work)

    return router


def mount(app: FastAPI, service: StudioService, api_key: str | None, allow_files: bool) -> None:
    app.include_router(build_router(service, api_key, allow_files))
