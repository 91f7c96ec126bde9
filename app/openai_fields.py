"""Every field of OpenAI's chat-completions and completions requests, and what this server does with it.

One table per endpoint: the request parsers refuse what the table refuses, with a 400 naming the
field, and the README shows the tables as `fields_markdown` writes them (a test keeps them equal). Nothing a client sends
is silently ignored: a field is implemented, refused, or accepted where its value changes nothing here
(a neutral value, such as `logprobs: false`), and an unknown field is refused, as OpenAI refuses it.
The table is also the protocol's one table of its own limits (`Field.limit`); every other value is
checked by the studio service, as it is for the UI.
"""

from __future__ import annotations

import dataclasses

from pipeline.llm.engine.params import Limit

IMPLEMENTED, REFUSED, NO_EFFECT = "implemented", "refused", "accepted, changes nothing here"
CHOICES = Limit(1, 8, whole=True)  # `n`: each choice is a row of the engine's batch of 8


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    status: str
    note: str
    neutral: tuple = (None,)  # values accepted even when the field is refused: they ask for nothing
    limit: Limit | None = None  # a limit of the protocol's own (the service checks every other value)

    def refuses(self, value: object) -> bool:
        return self.status == REFUSED and not any(value == n and type(value) is type(n) for n in self.neutral)


CHAT_FIELDS = [
    Field("model", IMPLEMENTED, "the running chat model, another chat model found (Chat switches to it), or "
                                "image chat's model (the VLM's id, or `minigpt4`); unknown: 404"),
    Field("messages", IMPLEMENTED, "`system`, `developer` (as `system`), `user` (text parts, at most one "
                                   "`image_url`: base64 `data:` URL), `assistant` (with `tool_calls`; last: the reply "
                                   "continues it), `tool` (a call's result)"),
    Field("stream", IMPLEMENTED, "server-sent events ending `data: [DONE]`"),
    Field("stream_options", IMPLEMENTED, "`include_usage`: a last chunk with usage"),
    Field("max_tokens", IMPLEMENTED, "1–32768"),
    Field("max_completion_tokens", IMPLEMENTED, "as `max_tokens`"),
    Field("temperature", IMPLEMENTED, "0–2 (0: greedy)"),
    Field("top_p", IMPLEMENTED, "(0, 1]"),
    Field("seed", IMPLEMENTED, "the same seed and request give the same reply"),
    Field("stop", IMPLEMENTED, "a string or up to 4"),
    Field("n", IMPLEMENTED, f"{CHOICES.low}–{CHOICES.high} choices, decoded side by side in the batch, each one of "
                            f"the client's replies in flight (a client with none may ask for {CHOICES.high}); a "
                            f"seeded request's choice i uses seed + i",
          limit=CHOICES),
    Field("user", IMPLEMENTED, "the client whose replies in flight are limited (429 past 4)"),
    Field("top_k", IMPLEMENTED, "extension: 0–1000 (0: off)"),
    Field("repetition_penalty", IMPLEMENTED, "extension: 0.5–3 (transformers' rule, prompt included)"),
    Field("mask", IMPLEMENTED, "extension: a PNG data URL beside an image; image chat answers about that object"),
    Field("collection", IMPLEMENTED, "extension: a document collection's name; the reply answers from its passages, "
                                     "citing them as [1], and the message carries the `sources` it cited (file, "
                                     "page, text, link)"),
    Field("prompt_cache_key", NO_EFFECT, "cached prefixes are found by content, whoever sends them"),
    Field("safety_identifier", NO_EFFECT, "no abuse monitoring runs here"),
    Field("service_tier", REFUSED, "one tier here", (None, "auto", "default")),
    Field("store", REFUSED, "this server stores no completions", (None, False)),
    Field("metadata", REFUSED, "only used with `store`", (None, {})),
    Field("presence_penalty", IMPLEMENTED, "-2–2: minus this from each token the reply has used"),
    Field("frequency_penalty", IMPLEMENTED, "-2–2: minus this times how often the reply has used the token"),
    Field("logprobs", IMPLEMENTED, "each token's log-probability: log-softmax of the model's logits (fp32), before "
                                   "sampling settings and grammars"),
    Field("top_logprobs", IMPLEMENTED, "0–20 most likely tokens at each place (with `logprobs`)"),
    Field("logit_bias", IMPLEMENTED, "{token id: -100–100} added to those tokens' logits before sampling (ids of "
                                     "the model's own tokenizer, up to 300; torch engine)"),
    Field("response_format", IMPLEMENTED, "`text`, `json_object`, `json_schema` (strict or not, enforced by a "
                                          "grammar while decoding; torch engine)"),
    Field("tools", IMPLEMENTED, "functions, written as the model's family writes them (Qwen2/2.5/3 chat templates, "
                                "Qwen v1 ReAct); LLaMA/Vicuna: 400"),
    Field("tool_choice", IMPLEMENTED, "`none`, `auto`, `required` or a named function (forced by a grammar: "
                                      "arguments valid for its schema)"),
    Field("parallel_tool_calls", IMPLEMENTED, "`false`: at most one call per reply"),
    Field("functions", REFUSED, "deprecated by OpenAI: use `tools`", (None, [])),
    Field("function_call", REFUSED, "deprecated by OpenAI: use `tool_choice`", (None, "none", "auto")),
    Field("modalities", REFUSED, "text only", (None, ["text"])),
    Field("audio", REFUSED, "no audio output"),
    Field("prediction", REFUSED, "no predicted outputs"),
    Field("reasoning_effort", REFUSED, "not a reasoning-effort model"),
    Field("verbosity", REFUSED, "not a verbosity-tuned model"),
    Field("web_search_options", REFUSED, "no web search"),
]
SHARED = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user",
          "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias"}
COMPLETION_FIELDS = [
    Field("prompt", IMPLEMENTED, "a string (or a list of one), continued as plain text: no chat format"),
    *[f if f.name != "model" else Field("model", IMPLEMENTED, "a chat model (as in chat completions)")
      for f in CHAT_FIELDS if f.name in SHARED],
    Field("logprobs", IMPLEMENTED, "0–20: each token's log-probability and this many alternatives"),
    Field("echo", REFUSED, "the prompt is not repeated in the reply", (None, False)),
    Field("suffix", REFUSED, "no fill-in-the-middle", (None, "")),
    Field("best_of", REFUSED, "1 only", (None, 1)),
]


def limit_of(name: str, table: list[Field] = CHAT_FIELDS) -> Limit:
    """The protocol's own limit on field `name`."""
    return next(f.limit for f in table if f.name == name and f.limit is not None)


def refused_field(body: dict, table: list[Field] = CHAT_FIELDS) -> tuple[str, str] | None:
    """(field, why) for the first field of `body` this server refuses (per `table`), or None."""
    by_name = {f.name: f for f in table}
    for name, value in body.items():
        field = by_name.get(name)
        if field is None:
            return name, f"unrecognized request argument supplied: {name}"
        if field.refuses(value):
            return name, f"{name} is not supported by this server ({field.note})"
    return None


def fields_markdown(table: list[Field] = CHAT_FIELDS) -> str:
    """A table as the README shows it."""
    rows = ["| field | here | notes |", "|---|---|---|"]
    rows += [f"| `{f.name}` | {f.status} | {f.note} |" for f in table]
    return "\n".join(rows)
