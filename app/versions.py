"""Which stored message the version switcher (‹ 2 / 3 ›) under a chat shows, and what it says. Pure
functions of the store's `open` result: a message's `versions` are the ids in its place, oldest first."""

from __future__ import annotations

from collections.abc import Sequence


def shown(messages: Sequence[dict]) -> list[dict]:
    """The stored messages the Chatbot shows, in its order (system prompts are not shown)."""
    return [m for m in messages if m["role"] != "system"]


def switcher_target(messages: Sequence[dict], wanted: int | None) -> dict | None:
    """The message whose versions to offer: `wanted` (a message clicked) if it is shown and has
    others, else the last reply with others, else the last question with others; None: none has."""
    visible = shown(messages)
    for m in visible:
        if m["id"] == wanted and len(m["versions"]) > 1:
            return m
    for role in ("assistant", "user"):
        for m in reversed(visible):
            if m["role"] == role and len(m["versions"]) > 1:
                return m
    return None


def switcher_label(message: dict) -> str:
    """"Reply 2 / 3" or "Your message 2 / 2"."""
    kind = "Reply" if message["role"] == "assistant" else "Your message"
    return f"{kind} {message['versions'].index(message['id']) + 1} / {len(message['versions'])}"


def neighbour(message: dict, step: int) -> int | None:
    """The version `step` places away (±1), or None past either end."""
    at = message["versions"].index(message["id"]) + step
    return message["versions"][at] if 0 <= at < len(message["versions"]) else None
