"""Every field of OpenAI's chat-completions request, and what this server does with it.

One table: `parse_request` refuses what the table refuses, with a 400 naming the field, and the
README shows the table as `fields_markdown` writes it (a test keeps them equal). Nothing a client sends
is silently ignored: a field is implemented, refused, or accepted where its value changes nothing here
(a neutral value, such as `logprobs: false`), and an unknown field is refused, as OpenAI refuses it.
"""

from __future__ import annotations

import dataclasses

IMPLEMENTED, REFUSED, NO_EFFECT = "implemented", "refused", "accepted, changes nothing here"


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    status: str
    note: str
    neutral: tuple = (None,)  # values accepted even when the field is refused: they ask for nothing

    def refuses(self, value: object) -> bool:
        return self.status == REFUSED and not any(value == n and type(value) is type(n) for n in self.neutral)


CHAT_FIELDS = [
    Field("model", IMPLEMENTED, "the running chat model, another chat model found (Chat switches to it), or "
                                "`minigpt4` (image chat); unknown: 404"),
    Field("messages", IMPLEMENTED, "`system`, `developer` (as `system`), `user` (text parts, at most one "
                                   "`image_url`: base64 `data:` URL), `assistant`"),
    Field("stream", IMPLEMENTED, "server-sent events ending `data: [DONE]`"),
    Field("stream_options", IMPLEMENTED, "`include_usage`: a last chunk with usage"),
    Field("max_tokens", IMPLEMENTED, "1–32768"),
    Field("max_completion_tokens", IMPLEMENTED, "as `max_tokens`"),
    Field("temperature", IMPLEMENTED, "0–2 (0: greedy)"),
    Field("top_p", IMPLEMENTED, "(0, 1]"),
    Field("seed", IMPLEMENTED, "the same seed and request give the same reply"),
    Field("stop", IMPLEMENTED, "a string or up to 4"),
    Field("n", IMPLEMENTED, "1 only", (None, 1)),
    Field("user", IMPLEMENTED, "the client whose replies in flight are limited (429 past 4)"),
    Field("top_k", IMPLEMENTED, "extension: 0–1000 (0: off)"),
    Field("repetition_penalty", IMPLEMENTED, "extension: 0.5–3 (transformers' rule, prompt included)"),
    Field("mask", IMPLEMENTED, "extension: a PNG data URL beside an image; image chat answers about that object"),
    Field("prompt_cache_key", NO_EFFECT, "cached prefixes are found by content, whoever sends them"),
    Field("safety_identifier", NO_EFFECT, "no abuse monitoring runs here"),
    Field("service_tier", REFUSED, "one tier here", (None, "auto", "default")),
    Field("store", REFUSED, "this server stores no completions", (None, False)),
    Field("metadata", REFUSED, "only used with `store`", (None, {})),
    Field("presence_penalty", IMPLEMENTED, "-2–2: minus this from each token the reply has used"),
    Field("frequency_penalty", IMPLEMENTED, "-2–2: minus this times how often the reply has used the token"),
    Field("logprobs", REFUSED, "not yet", (None, False)),
    Field("top_logprobs", REFUSED, "not yet", (None,)),
    Field("logit_bias", REFUSED, "not yet", (None, {})),
    Field("response_format", REFUSED, "not yet: only `{\"type\": \"text\"}`", (None, {"type": "text"})),
    Field("tools", REFUSED, "not yet", (None, [])),
    Field("tool_choice", REFUSED, "not yet", (None, "none", "auto")),
    Field("parallel_tool_calls", NO_EFFECT, "no tools yet, so no calls to run in parallel"),
    Field("functions", REFUSED, "deprecated by OpenAI for `tools`; not yet", (None, [])),
    Field("function_call", REFUSED, "deprecated by OpenAI for `tool_choice`; not yet", (None, "none", "auto")),
    Field("modalities", REFUSED, "text only", (None, ["text"])),
    Field("audio", REFUSED, "no audio output"),
    Field("prediction", REFUSED, "no predicted outputs"),
    Field("reasoning_effort", REFUSED, "not a reasoning-effort model"),
    Field("verbosity", REFUSED, "not a verbosity-tuned model"),
    Field("web_search_options", REFUSED, "no web search"),
]
BY_NAME = {f.name: f for f in CHAT_FIELDS}


def refused_field(body: dict) -> tuple[str, str] | None:
    """(field, why) for the first field of `body` this server refuses, or None."""
    for name, value in body.items():
        field = BY_NAME.get(name)
        if field is None:
            return name, f"unrecognized request argument supplied: {name}"
        if field.refuses(value):
            return name, f"{name} is not supported by this server ({field.note})"
    return None


def fields_markdown() -> str:
    """The table as the README shows it."""
    rows = ["| field | here | notes |", "|---|---|---|"]
    rows += [f"| `{f.name}` | {f.status} | {f.note} |" for f in CHAT_FIELDS]
    return "\n".join(rows)
