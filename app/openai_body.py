"""A `/v1` request's body, read and checked before the protocol looks at it: its size, its JSON, how deep
it nests, and that its text is Unicode.

Why here, once: each of these failed deep inside the server. A body was read whole before its size was
checked (a 256 MiB upload cost 475 MB), so the limit is enforced while the stream is read. JSON
nested a thousand levels deep made the decoder recurse past Python's limit, and what parses may
recurse again later (a schema made into a grammar), so the nesting is bounded. JSON may escape half
of a UTF-16 pair (`"\\ud800"`), which decodes to a lone surrogate that no tokenizer can encode, so
text must be whole characters. Each is a 4xx in OpenAI's shape, naming where it is, instead of a 500.
"""

from __future__ import annotations

import json
import re

from fastapi import Request

from app.openai_protocol import ApiError

MAX_BODY_BYTES = 32 << 20  # a data-URL image of a 12 MP photo fits; a 200 MB upload does not
MAX_DEPTH = 64  # objects and arrays inside each other: a request's layout takes under 10, schemas the rest
_SURROGATE = re.compile("[\ud800-\udfff]")


def _too_large() -> ApiError:
    # the rest of the body is never read, so the connection cannot carry another request: closed
    return ApiError(413, f"the request body is too large: the limit is {MAX_BODY_BYTES >> 20} MiB",
                    headers={"Connection": "close"})


async def read_json(request: Request) -> object:
    """The request's body as JSON, or `ApiError`: 413 past `MAX_BODY_BYTES` (from its Content-Length,
    before reading any of it, else as soon as the stream passes the limit), 400 for JSON that does not
    parse, nests deeper than `MAX_DEPTH` or holds a lone surrogate."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except RecursionError:  # the decoder's own recursion ran out, thousands of levels down
        raise _too_deep(None, ()) from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    check_values(body)
    return body


def _spelled(path: tuple[str | int, ...]) -> str:
    """A place in the body as a client writes it: `messages[0].content`."""
    return "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path).lstrip(".")


def _too_deep(param: str | None, path: tuple[str | int, ...]) -> ApiError:
    where = f" (at {_spelled(path)[:120]})" if path else ""
    return ApiError(400, f"the body nests objects and arrays more than {MAX_DEPTH} levels deep{where}: send a "
                         f"flatter one", param)


def _check_text(text: str, where: str, param: str | None) -> None:
    if bad := _SURROGATE.search(text):
        raise ApiError(400, f"{where} holds a lone UTF-16 surrogate (\\u{ord(bad.group()):04x}), which is not a "
                            f"character: send the text as valid Unicode (a surrogate only in a pair)", param)


def check_values(body: object) -> None:
    """`ApiError` (400, naming the top-level field) where `body` nests deeper than `MAX_DEPTH` or a string
    (or key) in it holds a lone UTF-16 surrogate. Walked with a stack of its own, not recursion."""
    stack: list[tuple[object, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        param = path[0] if path and isinstance(path[0], str) else None
        if isinstance(value, str):
            _check_text(value, _spelled(path) or "the body", param)
        elif isinstance(value, (dict, list)):
            if len(path) >= MAX_DEPTH:
                raise _too_deep(param, path)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, f"a key of {_spelled(path) or 'the body'}", param)  # not the key: unsendable
                stack.append((item, (*path, key)))
