"""The `/v1` protocol: an OpenAI request checked into one call of the studio service, and the
service's errors in OpenAI's shape.

Only translation lives here. Every rule about a reply (sampling limits, messages, tools, how many
replies a client may have in flight) is the service's, so API and UI users get the same checks;
the protocol's own limits are in the fields table (`app.openai_fields`). A request with an
`image_url` part, or for image chat's model (`service.image_models()`: the VLM's id, or `minigpt4`), goes
to image chat. A client is the request's `user`:
requests without one stand alone (scripts and apps on this machine all share one address, and one's
parallel requests must not refuse another's).
"""

from __future__ import annotations

import base64
import dataclasses
import secrets
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path

from fastapi.responses import JSONResponse

from app.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, limit_of, refused_field
from pipeline.errors import UserError
from pipeline.llm.text.structure import Structure
from pipeline.service.in_flight import Busy
from pipeline.service.requests import ChatTurn, Update
from pipeline.service.studio import StudioService
from pipeline.service.tools import Tool

class ApiError(Exception):
    """An error in OpenAI's shape: HTTP `status`, a message, its type, and the parameter it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"message": self.message, "type": kind, "param": self.param, "code": self.code}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status, headers=self.headers)


def api_error(e: BaseException, names: Mapping[str, str] | None = None) -> ApiError:
    """`e` in OpenAI's shape, by its type and the field it names: the service's `Busy` is a 429, its other
    `UserError`s a 400 naming the request's field (`names`: the service's name of a field → the
    request's), anything else the server's fault."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Busy):
        return ApiError(429, str(e), code="too_many_requests")
    if isinstance(e, UserError):
        return ApiError(400, str(e), (names or {}).get(e.param, e.param))
    return ApiError(500, f"the server failed: {type(e).__name__}")


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A checked request: the model it names, the service's turn, its `n` choices and how to answer."""

    model: str
    turn: ChatTurn
    n: int
    client: str
    completion: bool  # `/v1/completions` (else chat completions)
    stream: bool
    include_usage: bool
    max_calls: int | None  # parallel_tool_calls false: one call per choice
    names: Mapping[str, str]  # the service's name of a field → this request's (for errors)

    def answer(self, service: StudioService, cancels: list[threading.Event]) -> Iterator[tuple[int, Update]]:
        """The one service call that answers it: its choices' (index, update) as they come, one Stop
        flag per choice in `cancels`."""
        return service.choices(self.client, self.turn, cancels)


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


def _logprobs_wanted(body: dict, completion: bool) -> object:
    """The service's `logprobs` (how many alternatives per token; None: no log-probabilities) from
    completions' `logprobs` or chat's `logprobs` and `top_logprobs`; the service checks the number."""
    if completion:
        return body.get("logprobs")
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, f"logprobs must be true or false, got {wanted!r:.40}", "logprobs")
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (0 if top is None else top) if wanted else None


def _flag(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {value!r:.40}", name)
    return value


def parse_request(body: object, allow_files: bool, service: StudioService, completion: bool = False) -> ChatRequest:
    """A chat-completions request (a completions one with `completion`) checked by the service, or
    `ApiError` naming what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    table = COMPLETION_FIELDS if completion else CHAT_FIELDS
    if refused := refused_field(body, table):
        raise ApiError(400, refused[1], refused[0])
    model = body.get("model")
    image_models = service.image_models()
    if not isinstance(model, str) or not (model in image_models and not completion or service.serves(model)):
        models = [*service.chat_models(), *([] if completion else image_models[:1])]
        raise ApiError(404, f"model {model!r} does not exist here: use one of {', '.join(models)}", "model",
                       "model_not_found")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"user must be a string, got {user!r:.40}", "user")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    names = {"max_new_tokens": max_name, "image": "messages", **({} if completion else {"logprobs": "top_logprobs"})}
    sampling = {"max_new_tokens": body.get(max_name), "logprobs": _logprobs_wanted(body, completion),
                **{name: body.get(name) for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed",
                                                     "stop", "presence_penalty", "frequency_penalty",
                                                     "logit_bias")}}
    try:  # absent sampling values are the model's own (its generation_config.json), else neutral
        n = 1 if body.get("n") is None else int(limit_of("n", table).check("n", body["n"]))
        structure = Structure.from_openai(body.get("tools"), body.get("tool_choice"), body.get("response_format"))
        if completion:
            turn = service.completion_turn(body.get("prompt"), sampling, model=model, model_defaults=True)
        else:
            messages, image = _messages(body.get("messages"), allow_files)
            mask = _image_bytes(body["mask"], allow_files) if body.get("mask") is not None else None
            tool = Tool.IMAGE_CHAT if model in image_models or image else Tool.CHAT
            turn = service.chat_turn(messages, sampling, tool=tool, image=image, mask=mask, model=model,
                                     structure=structure, model_defaults=True, collection=body.get("collection"))
    except UserError as e:
        raise api_error(e, names) from None
    options = body.get("stream_options") or {}
    return ChatRequest(service.image_models()[0] if turn.tool == Tool.IMAGE_CHAT else model, turn, n,
                       f"api:user:{user}" if user else f"api:request:{secrets.token_hex(8)}", completion,
                       bool(_flag(body, "stream")), bool(isinstance(options, dict) and options.get("include_usage")),
                       1 if _flag(body, "parallel_tool_calls") is False else None, names)
