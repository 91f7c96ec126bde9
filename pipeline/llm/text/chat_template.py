"""A checkpoint's Jinja chat template, rendered in Jinja's immutable sandbox.

Why our own renderer: loading transformers only to render a template cost most of a second
launch (the import pulls in torch.distributed and scikit-learn: seconds). The template is untrusted
text from a model folder, so it runs in `ImmutableSandboxedEnvironment` (jinja2 ≥ 3.1.6, whose
sandbox escapes are fixed), can only read the plain data it is given, and cannot store
underscore-prefixed names on a namespace. It sees what the Hub's templates expect from
transformers' renderer: `messages`, `add_generation_prompt`, `tools`, the special tokens'
spellings (`bos_token`, `eos_token`, ...), `raise_exception`, `strftime_now`, a `tojson` that does
not escape HTML, loop controls, and the `{% generation %}` block (rendered as its content).
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.errors import UserError


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks an assistant turn for training masks; rendering a
    prompt only needs its content."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attribute names (no route to Python internals)."""

    def __init__(*args: Any, **kwargs: Any):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise UserError(f"chat templates need jinja2 ≥ 3.1.6 (its sandbox fixes); this is {jinja2.__version__}: "
                        "pip install -U jinja2")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_Namespace,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


class ChatTemplate:
    """One compiled template; `render` gives the prompt text (special tokens still spelled out)."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        self._source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise UserError(f"the model's chat template does not parse: {e}") from None
        self._special_tokens = dict(special_tokens)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text; an assistant message last is continued: the text stops right after its
        content, with no end of turn (as transformers' `continue_final_message`)."""
        last = messages[-1] if messages else {}
        continuing = last.get("role") == "assistant"
        try:
            text = self._template.render(messages=messages, tools=tools or None, add_generation_prompt=not continuing,
                                         **self._special_tokens)
        except Exception as e:  # noqa: BLE001 - a broken or hostile template in the model folder
            detail = str(e).splitlines()[0] if str(e) else "no details"
            raise UserError(f"the model's chat template failed: {type(e).__name__}: {detail}"[:300]) from None
        if not continuing:
            return text
        content = last.get("content") or ""
        end = text.rfind(content) if content.strip() else -1
        if end < 0:
            raise UserError("the model's chat template does not show the last assistant message, so it cannot be "
                            "continued", "messages")
        return text[:end + len(content)]

    @property
    def takes_tools(self) -> bool:
        """Whether the template writes a `tools` list into the prompt (Qwen2/2.5/3's do)."""
        return "tools" in self._source
