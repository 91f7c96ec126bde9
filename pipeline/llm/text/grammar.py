"""Constrained decoding: a grammar per request, enforced on the logits with a token mask.

We use llguidance (measured against xgrammar and outlines-core in `bench/grammar_libraries.py`: on
the real 151k Qwen vocabulary its per-step mask costs the same as xgrammar's, ~40 µs, but a new JSON
schema is ready in ~1 ms instead of xgrammar's ~2 s compile, which a request would wait for before
its first token; outlines-core needs seconds to build each schema's index and ~2 ms per step).

`GrammarVocabulary` is built once per loaded model from our own tokenizer's byte table, so the same
code serves HF `tokenizers`, Qwen v1 tiktoken and SentencePiece vocabularies. Each request gets a
`Grammar` (its own matcher: the row's grammar state in the continuous batch); the engine turns the rows'
matchers into token masks (`pipeline.llm.engine.grammar_masks`). Torch-free: the engine's contract names
`Grammar`, and the HTTP client of `--llm-endpoint` imports that contract.
"""

from __future__ import annotations

import json

from pipeline.errors import UserError
from pipeline.llm.text.tokenizer import Tokenizer

# A reply's JSON written as the models write it: one space after ':' and ',', no free whitespace runs
# (a sampled model could otherwise pad a reply with whitespace until it runs out of tokens).
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class _Wrapper:
    """What llguidance's `TokenizerWrapper` reads: each id's bytes (special tokens marked with the 0xFF
    byte llguidance expects, so text can never spell them), the end ids, and a tokenize function."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: set[int]):
        specials = tokenizer.special_ids | set(stop_ids)
        self.tokens = [b"\xff" + tokenizer.token_bytes(i) if i in specials else tokenizer.token_bytes(i)
                       for i in range(min(vocab_size, tokenizer.vocab_size))]
        self.tokens += [b"\xff<unused>"] * (vocab_size - len(self.tokens))
        self.eos_token_id = min(stop_ids)
        self.bos_token_id = None
        self.special_token_ids = sorted(specials & set(range(vocab_size)))
        self._encode = tokenizer.encode
        self._ids = {t: i for i, t in enumerate(self.tokens) if t and not t.startswith(b"\xff")}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        """Ids whose bytes are exactly `text` (the library tokenizes text it forces): the tokenizer's own
        where it gives that, else a greedy longest match (SentencePiece adds a space in front of text)."""
        data = text if isinstance(text, bytes) else text.encode()
        try:
            ids = self._encode(data.decode())
        except UnicodeDecodeError:
            ids = []
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        out, at = [], 0
        while at < len(data):
            size = next(n for n in range(min(self._longest, len(data) - at), 0, -1)
                        if data[at:at + n] in self._ids or n == 1)
            out.append(self._ids.get(data[at:at + size], 0))
            at += size
        return out


class GrammarVocabulary:
    """A model's vocabulary as the grammar library sees it (built once per model: ~1 s for 152k tokens)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: set[int]):
        import llguidance

        self.vocab_size = vocab_size
        ends = [0] * bitmask_words(vocab_size)  # a mask that allows only the end ids, as int32 words
        for i in stop_ids:
            ends[i // 32] |= _bit(i % 32)
        self._ends = tuple(ends)
        wrapper = _Wrapper(tokenizer, vocab_size, stop_ids)
        self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), n_vocab=vocab_size,
                                                 eos_token=sorted(stop_ids))

    def grammar(self, source: str, param: str) -> "Grammar":
        """A fresh matcher for `source` (a Lark grammar, or one made by `json_schema_grammar`); a grammar
        the library rejects is a `UserError` naming the request's `param`."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(source)
        if error:
            raise UserError(f"{param}: {error.splitlines()[0][:300]}", param)
        return Grammar(llguidance.LLMatcher(self._tokenizer, source, log_level=0), self._ends)


# What a number may be where its schema does not say: JSON's interoperable integers (RFC 8259: IEEE doubles'
# exact ones) and ten decimals. Unbounded, a small model can write "1111…" until it runs out of tokens.
LARGEST_NUMBER = 2**53 - 1
DECIMALS = 1e-10
_SUBSCHEMAS = ("items", "additionalProperties", "then", "else", "contains")  # not "not" nor "if": a bound there widens
_SCHEMA_LISTS = ("prefixItems", "anyOf", "allOf", "oneOf")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def bounded_numbers(schema: object) -> object:
    """`schema` with a bound on every number and integer it allows that has none of its own (a copy; bounds the
    schema gives are kept): what a schema-following reply may write stays finite, so it always closes."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    types = out.get("type")
    if {"number", "integer"} & set([types] if isinstance(types, str) else types or []):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -LARGEST_NUMBER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = LARGEST_NUMBER
        if "number" in ([types] if isinstance(types, str) else types) and "multipleOf" not in out:
            out["multipleOf"] = DECIMALS
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = bounded_numbers(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_numbers(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_numbers(s) for name, s in out[key].items()}
    return out


def json_schema_grammar(schema: dict | bool) -> str:
    """The grammar of JSON values valid for `schema` (`{"type": "object"}`: any object), numbers bounded."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(bounded_numbers(schema), overrides=JSON_LAYOUT)
    except ValueError as e:
        raise UserError(f"response_format: the JSON schema cannot be used: {str(e).splitlines()[0][:300]}",
                        "response_format") from None


def lark_json(schema: dict) -> str:
    """A JSON value valid for `schema`, as a term inside a Lark grammar (llguidance's `%json`)."""
    return "%json " + json.dumps({**bounded_numbers(schema), "x-guidance": JSON_LAYOUT})


class Grammar:
    """One request's grammar state: which tokens may come next (`matcher`, llguidance's), advanced by each token
    drawn; `ends`: the mask of the end ids alone, as int32 words (what a matcher in error allows)."""

    def __init__(self, matcher, ends: tuple[int, ...]):
        self.matcher, self.ends = matcher, ends

    def consume(self, token: int) -> bool:
        """Advance past the drawn `token` (a stop id ends the grammar); whether it was taken (a stopped
        grammar takes nothing)."""
        if self.matcher.is_stopped():
            return False
        self.matcher.consume_token(token)
        return True

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (a speculative draft is cut there)."""
        return self.matcher.validate_tokens(tokens) if tokens and not self.matcher.is_stopped() else 0

    def rollback(self, tokens: int) -> None:
        """Undo the last `tokens` taken (a draft's, once its masks are made)."""
        if tokens:
            self.matcher.rollback(tokens)

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def _bit(i: int) -> int:
    """Bit `i` of an int32 word (bit 31 is the sign bit)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
