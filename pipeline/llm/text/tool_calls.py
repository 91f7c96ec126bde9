"""Tool calls as each model family writes them: in its prompt, in its replies, and as a grammar.

Qwen2/2.5/3 (`TaggedCalls`): the chat template lists the tools, and the model answers with
`<tool_call>{"name": …, "arguments": {…}}</tool_call>`; results come back as `tool` messages, which
the template writes itself. A ChatML template that writes no tools (SmolLM2's) gets the same layout
written into the messages it renders (`TaggedCallsInMessages`), as Hermes-style tool prompts do.
Qwen v1 (`ReActCalls`) has no template: its ReAct format (as Qwen's own OpenAI server writes it)
puts the tools and the Thought / Action / Action Input / Observation layout in the question, and a
tool's result becomes the Observation the model continues from. A `CallReader` turns the reply's
text into content and `ToolCall`s as it streams. `grammar` gives the Lark grammar that makes a model
call a tool (`tool_choice` `required` or a named function), with the arguments valid for the
function's JSON schema.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Sequence
from typing import Protocol

from pipeline.llm.text.grammar import lark_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


def _parse_arguments(text: str) -> str | None:
    """A call's arguments as compact JSON text, or None when they are not a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class CallReader(Protocol):
    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """More reply text in; the content that is final now, and the calls completed by it."""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the reply: what is still held."""


class TaggedReader:
    """Reads `<tool_call>{json}</tool_call>` blocks out of a reply as it streams; text that could be
    the start of a block is held back until it is known not to be."""

    def __init__(self):
        self._held, self._inside, self._calls = "", False, 0

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        content, calls = "", []
        while True:
            if self._inside:
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                call = self._call(self._held[:end])
                self._held, self._inside = self._held[end + len(CLOSE):], False
                if call is None:  # not a call after all: the text stays the reply's
                    content += OPEN + self._held[:end] + CLOSE
                else:
                    calls.append(call)
                continue
            start = self._held.find(OPEN)
            if start < 0:
                hold = max((n for n in range(len(OPEN) - 1, 0, -1) if self._held.endswith(OPEN[:n])), default=0)
                content += self._held[:len(self._held) - hold]
                self._held = self._held[len(self._held) - hold:]
                break
            content += self._held[:start]
            self._held, self._inside = self._held[start + len(OPEN):], True
        return self._content(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if self._inside:  # an unclosed block: a call if what it holds is one
            call = self._call(held)
            return ("", [call]) if call is not None else (self._content(OPEN + held), [])
        return self._content(held), []

    def _call(self, text: str) -> ToolCall | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", {})
        self._calls += 1
        return ToolCall(value["name"], _parse_arguments(arguments) or "{}" if isinstance(arguments, str)
                        else json.dumps(arguments, ensure_ascii=False))

    def _content(self, text: str) -> str:
        return "" if self._calls and not text.strip() else text  # the line breaks between calls


FINAL = "Final Answer:"


class ReActReader:
    """Reads Qwen v1's ReAct reply: the text after `Final Answer:` streams as it comes (trailing
    whitespace held back until more text follows); `Action:` + `Action Input:` is a call (its Thought
    the content), read when the reply ends at `Observation:`. Until one of the two shows, nothing is
    shown: a Thought is not the answer."""

    def __init__(self):
        self._text, self._answer_at, self._sent = "", -1, 0

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._text += text
        if self._answer_at < 0:
            at = self._text.find(FINAL)
            if at < 0 or "\nAction Input:" in self._text[:at]:
                return "", []
            self._answer_at = at + len(FINAL)
        answer = self._text[self._answer_at:].strip()
        out, self._sent = answer[self._sent:], len(answer)
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self._answer_at >= 0:
            return "", []
        text = self._text
        action, given = text.rfind("\nAction:"), text.rfind("\nAction Input:")
        if 0 <= action < given:
            name = text[action + len("\nAction:"):given].strip()
            arguments = text[given + len("\nAction Input:"):].split("\nObservation", 1)[0].strip()
            thought = text[:action].strip().removeprefix("Thought:").strip()
            return thought, [ToolCall(name, _parse_arguments(arguments) or json.dumps({"input": arguments}))]
        return text.strip(), []


def _function(tool: dict) -> dict:
    return tool["function"]


def _parameters(tool: dict) -> dict:
    return _function(tool).get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


class TaggedCalls:
    """Qwen2/2.5/3: the chat template writes tools, calls and results; see the module docstring."""

    stop_strings: tuple[str, ...] = ()

    @staticmethod
    def messages(messages: Sequence[dict], tools: Sequence[dict]) -> list[dict]:
        """The messages as the template reads them: a call's arguments as a JSON object, not text."""
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [{"type": "function", "function": {
                    "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in m["tool_calls"]]
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out

    @staticmethod
    def grammar(tools: Sequence[dict]) -> str:
        """One call of one of `tools`, its arguments valid for that function's schema."""
        schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": _function(t)["name"]},
                                                              "arguments": _parameters(t)},
                             "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
        return f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: {lark_json(schema)}\n'

    @staticmethod
    def reader() -> CallReader:
        return TaggedReader()


# Qwen2.5's system-prompt tools section (Hermes' layout), word for word; `{tools}` is one JSON line per tool.
TOOLS_SECTION = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                 "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>"
                 "\n\nFor each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}}\n</tool_call>")


class TaggedCallsInMessages(TaggedCalls):
    """Tagged calls for a ChatML chat template that has no tools of its own (SmolLM2's): the model is
    not trained on a tool layout, so it gets the most common one, Qwen2.5's (Hermes'), written into
    the plain messages its template renders: the tools section at the end of the system message,
    earlier calls as `<tool_call>` blocks in the assistant's text, results as `<tool_response>`
    blocks in a user turn (consecutive results in one). The replies read and the grammar are
    `TaggedCalls`'."""

    @staticmethod
    def messages(messages: Sequence[dict], tools: Sequence[dict]) -> list[dict]:
        out: list[dict] = []
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                response = f"<tool_response>\n{m['content']}\n</tool_response>"
                if i and messages[i - 1]["role"] == "tool":
                    out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{response}"}
                else:
                    out.append({"role": "user", "content": response})
                continue
            if m.get("tool_calls"):
                blocks = [f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": json.loads(c["function"]["arguments"])},
                                                   ensure_ascii=False) + f"\n{CLOSE}" for c in m["tool_calls"]]
                m = {"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + blocks)}
            out.append(m)
        if tools:
            section = TOOLS_SECTION.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
            else:
                out.insert(0, {"role": "system", "content": section})
        return out


REACT_INSTRUCTION = """Answer the following questions as best you can. You have access to the following tools:

{tools}

Use the following format:

Question: the input question you must answer
Thought: you should always think about what to do
Action: the action to take, should be one of [{names}]
Action Input: the input to the action
Observation: the result of the action
... (this Thought/Action/Action Input/Observation can be repeated zero or more times)
Thought: I now know the final answer
Final Answer: the final answer to the original input question

Begin!

Question: {question}"""


class ReActCalls:
    """Qwen v1's ReAct format; see the module docstring."""

    stop_strings = ("Observation:",)  # the model would go on to invent the tool's result

    @staticmethod
    def messages(messages: Sequence[dict], tools: Sequence[dict]) -> list[dict]:
        """The conversation in ReAct form: the tools and the format in the last question; a call and
        its results as one assistant turn ending in an Observation, continued by the reply when last."""
        described = "\n\n".join(
            f"{_function(t)['name']}: {_function(t).get('description', '')} Parameters: "
            f"{json.dumps(_parameters(t), ensure_ascii=False)} Format the arguments as a JSON object."
            for t in tools)
        names = ", ".join(_function(t)["name"] for t in tools)
        last_question = max(i for i, m in enumerate(messages) if m["role"] == "user")
        out: list[dict] = []
        for i, m in enumerate(messages):
            if i == last_question:
                m = {"role": "user", "content": REACT_INSTRUCTION.format(tools=described, names=names,
                                                                          question=m["content"])}
            elif m.get("tool_calls"):
                steps = [f"Thought: {m['content'] or 'I should use a tool.'}"]
                for c in m["tool_calls"]:
                    steps.append(f"Action: {c['function']['name']}\nAction Input: {c['function']['arguments']}")
                m = {"role": "assistant", "content": "\n".join(steps)}
            elif m["role"] == "assistant" and out and out[-1]["content"].endswith("\nThought:"):
                out[-1] = {"role": "assistant", "content": f"{out[-1]['content']} I now know the final answer\n"
                                                           f"Final Answer: {m['content']}"}
                continue
            elif m["role"] == "tool":
                out[-1] = {"role": "assistant", "content": f"{out[-1]['content']}\nObservation: {m['content']}"}
                if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                    out[-1]["content"] += "\nThought:"  # the reply goes on from here
                continue
            out.append(m)
        return out

    @staticmethod
    def grammar(tools: Sequence[dict]) -> str:
        """A thought on one line, then one call of one of `tools` with valid arguments."""
        calls = [f'"{_function(t)["name"]}\\nAction Input: " {lark_json(_parameters(t))}' for t in tools]
        return ('start: THOUGHT "\\nAction: " call "\\nObservation:"\nTHOUGHT: /[^\\n]{1,160}/\n'
                f"call: {' | '.join(calls)}\n")

    @staticmethod
    def reader() -> CallReader:
        return ReActReader()
