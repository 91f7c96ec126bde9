"""A chat conversation as a file and back: JSON (exact, with the system prompt) and Markdown (for
people, and read back too), so a conversation can be kept, shared and continued elsewhere."""

from __future__ import annotations

import contextlib
import json
import re

from pipeline.errors import UserError
from pipeline.service.tools import Tool

FORMAT = "ai-studio-conversation"
HEADINGS = {"user": "User", "assistant": "Assistant", "system": "System"}
HEADING = re.compile(r"^### (User|Assistant|System)\s*$", re.MULTILINE)
MAX_IMPORT_BYTES = 8 << 20


def to_json(history: list[dict], system_prompt: str) -> str:
    return json.dumps({"format": FORMAT, "version": 1, "system_prompt": system_prompt,
                       "messages": [{"role": m["role"], "content": m["content"]} for m in history]},
                      ensure_ascii=False, indent=1)


def to_markdown(history: list[dict], system_prompt: str) -> str:
    parts = ["# Conversation (AI Studio)\n"]
    for role, text in [("system", system_prompt)] * bool(system_prompt) + [(m["role"], m["content"]) for m in history]:
        parts.append(f"### {HEADINGS[role]}\n\n{text.strip()}\n")
    return "\n".join(parts)


def read_conversation(data: bytes, name: str) -> tuple[list[dict], str | None]:
    """(messages, system prompt or None) from a file `to_json` or `to_markdown` wrote."""
    if len(data) > MAX_IMPORT_BYTES:
        raise UserError(f"{name} is {len(data) >> 20} MiB; a conversation file is at most {MAX_IMPORT_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{name} is not a text file: export a conversation as JSON or Markdown first") from None
    if name.lower().endswith(".json"):
        return _from_json(text, name)
    return _from_markdown(text, name)


def _from_json(text: str, name: str) -> tuple[list[dict], str | None]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"{name} is not valid JSON ({e})") from None
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
            for m in messages):
        raise UserError(f"{name} holds no conversation: expected {{\"messages\": [{{\"role\", \"content\"}}, …]}}")
    system = data.get("system_prompt") if isinstance(data, dict) else None
    return [{"role": m["role"], "content": m["content"]} for m in messages], system if isinstance(system, str) else None


def _from_markdown(text: str, name: str) -> tuple[list[dict], str | None]:
    found = list(HEADING.finditer(text))
    if not found:
        raise UserError(f"{name} has no '### User' / '### Assistant' sections: export a conversation first")
    system, messages = None, []
    for match, following in zip(found, found[1:] + [None]):
        body = text[match.end():following.start() if following else len(text)].strip()
        role = {v: k for k, v in HEADINGS.items()}[match.group(1)]
        if role == "system":
            system = body
        else:
            messages.append({"role": role, "content": body})
    return messages, system


ARCHIVE = "ai-studio-conversations"


def to_archive(conversations: list[dict]) -> str:
    """Conversations as the conversation store exports them (images as hex), one JSON file."""
    return json.dumps({"format": ARCHIVE, "version": 1, "conversations": conversations}, ensure_ascii=False, indent=1)


def read_conversations(data: bytes, name: str) -> list[dict]:
    """What a file holds, as the store imports it: an archive's conversations, or one chat conversation
    from a file `to_json` or `to_markdown` wrote."""
    if name.lower().endswith(".json"):  # an archive holds images: only the upload limit bounds it
        with contextlib.suppress(ValueError):
            found = json.loads(data)
            if isinstance(found, dict) and found.get("format") == ARCHIVE:
                if not isinstance(found.get("conversations"), list):
                    raise UserError(f"{name} is an archive without its list of conversations")
                return found["conversations"]
    messages, system = read_conversation(data, name)
    return [{"tool": Tool.CHAT.value, "title": "", "system": system, "messages": messages}]
