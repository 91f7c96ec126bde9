"""What a request asks of a reply's form, in OpenAI's terms: tools it may (or must) call, and a JSON
schema its content must follow. Checked once here, whichever front end sent it; the language model
turns it into a prompt, a grammar and a reader of calls (`pipeline.llm.text.tool_calls`), and a remote
server (`--llm-endpoint`) gets the fields as they came.
"""

from __future__ import annotations

import dataclasses
import re

from pipeline.errors import UserError

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class Structure:
    tools: tuple[dict, ...] = ()  # OpenAI function tools, checked
    tool_choice: str = "none"  # "none" | "auto" | "required" | a function's name
    schema: dict | bool | None = None  # the JSON schema the content follows ({"type": "object"}: any object)
    fields: dict = dataclasses.field(default_factory=dict)  # the request's own fields, for a remote server

    @property
    def forced(self) -> list[dict]:
        """The tools one of which the reply must call (`required` or a named one), else []."""
        if self.tool_choice == "required":
            return list(self.tools)
        return [t for t in self.tools if t["function"]["name"] == self.tool_choice]

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @classmethod
    def from_openai(cls, tools: object = None, tool_choice: object = None,
                    response_format: object = None) -> "Structure":
        """The checked fields, or a `UserError` naming the one that is wrong."""
        fields = {k: v for k, v in (("tools", tools), ("tool_choice", tool_choice),
                                    ("response_format", response_format)) if v is not None}
        if tools is not None and not isinstance(tools, list) or len(tools or []) > MAX_TOOLS:
            raise UserError(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
        checked = tuple(_tool(t, i) for i, t in enumerate(tools or []))
        names = [t["function"]["name"] for t in checked]
        if len(set(names)) < len(names):
            raise UserError("tools: two functions have the same name", "tools")
        choice = _tool_choice(tool_choice, names)
        schema = _schema(response_format)
        if schema is not None and choice not in ("none", "auto"):
            raise UserError("response_format cannot be combined with a tool_choice that forces a call", "response_format")
        return cls(checked, choice, schema, fields)


def _tool(tool: object, i: int) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise UserError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise UserError(f"tools[{i}].function.name must be 1–64 letters, digits, _ or -, got {name!r:.80}", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise UserError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise UserError(f"tools[{i}].function.description must be text", "tools")
    return {"type": "function", "function": {k: v for k, v in function.items()
                                             if k in ("name", "description", "parameters") and v is not None}}


def _tool_choice(choice: object, names: list[str]) -> str:
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise UserError(f"tool_choice names a function that is not in tools: {name!r:.80}", "tool_choice")
        return name
    if choice not in ("none", "auto", "required"):
        raise UserError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                        f"{{\"name\": …}}}}, got {choice!r:.80}", "tool_choice")
    if choice == "required" and not names:
        raise UserError("tool_choice required needs tools", "tool_choice")
    return choice


def _schema(response_format: object) -> dict | bool | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise UserError("response_format json_schema needs {\"json_schema\": {\"name\": …, \"schema\": {…}}}",
                            "response_format")
        return schema
    raise UserError(f"response_format type must be text, json_object or json_schema, got {kind!r:.60}",
                    "response_format")
