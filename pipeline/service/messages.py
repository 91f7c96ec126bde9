"""Messages as every front end sends them, checked into one plain form: {role, content: text}, with an
assistant's earlier tool calls and a tool result's call id. A message that is not well formed is a
`UserError` naming it, the same words for the UI, `/v1` and the terminal."""

from __future__ import annotations

import json

from pipeline.errors import UserError
from pipeline.llm.text.prompt import ROLES


def text_of(content: object) -> str:
    """A message's text, whether it is a string or a list of parts (OpenAI's and Gradio's
    {"type": "text", "text": …}); other parts carry no text."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    parts = content if isinstance(content, list) else [content]
    return "".join(p.get("text") or "" if isinstance(p, dict) else p if isinstance(p, str) else "" for p in parts)


# How a reply cut by a crash is shown (after its text); taken off again when the conversation goes on, so the
# model never reads it
INTERRUPTED = "\n\n*(interrupted: the app stopped before this reply ended)*"
# Where the box of a reply's document sources starts (the UI shows it under the reply): cut off, so the model
# never reads it
SOURCES_START = '\n\n<details class="studio-sources">'


def plain_messages(raw: object, name: str = "messages") -> list[dict]:
    """`raw` as {role, content: text} messages; anything else is a `UserError` naming `name` (the
    front end's word for them: the UI's API says "history")."""
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)):
        raise UserError(f"{name} must be a list of {{role, content}}, got {type(raw).__name__}", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise UserError(f"{name}[{i}] must be {{'role': one of {', '.join(ROLES)}, 'content': text}}, "
                            f"got {m!r:.80}", "messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list, dict)):
            raise UserError(f"{name}[{i}].content must be text or a list of parts", "messages")
        message = {"role": m["role"], "content": text_of(content)}
        if m["role"] == "assistant":
            message["content"] = message["content"].split(SOURCES_START)[0].removesuffix(INTERRUPTED)
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{name}[{i}].tool_calls")
        if m["role"] == "tool":
            message["tool_call_id"] = str(m.get("tool_call_id") or "")
        out.append(message)
    return out


def _tool_calls(raw: object, name: str) -> list[dict]:
    """An assistant message's earlier calls, checked: each a function's name and JSON-object arguments."""
    calls = []
    for i, call in enumerate(raw if isinstance(raw, list) else [None]):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        try:
            ok = isinstance(function.get("name"), str) and isinstance(json.loads(arguments), dict)
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            raise UserError(f"{name}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …, "
                            f"\"arguments\": a JSON object as text}}}}", "messages")
        calls.append({"id": str(call.get("id") or ""), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def last_turn(messages: object) -> tuple[list[dict], str]:
    """(the messages before the last user message, that message's text): what regenerate resends and
    edit gives back to change."""
    history = plain_messages(messages)
    while history and history[-1]["role"] == "assistant":
        history.pop()
    if not history or history[-1]["role"] != "user":
        raise UserError("there is no message of yours to regenerate or edit yet", "messages")
    return history[:-1], history[-1]["content"]
