"""Which grammar library constrains our decoding: xgrammar, llguidance or outlines-core, measured.

All three turn a JSON schema into a per-step token mask; what a serving engine pays is (a) compiling a
request's schema before its first token and (b) the host time to compute each step's mask, which our
engine overlaps with the GPU's forward pass. Both are measured here on the real Qwen vocabulary
(151,643 byte-level BPE tokens from `qwen.tiktoken`, as Qwen v1 and Qwen2 use), walking each library
through the same valid reply token by token, in the same run. CPU only: the mask is host work.

    python bench/grammar_libraries.py --vocab .whl/qwen.tiktoken [--out grammar_libraries]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1"}, "active": True}


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def encoding(ranks: dict[bytes, int]):
    import tiktoken

    pattern = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding("qwen", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks)})


def run_xgrammar(vocab: list[bytes], eos: int, reply: list[int]) -> dict:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, len(vocab))
    steps = []
    for token in [*reply, eos]:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        steps.append(time.perf_counter() - t0)
        allowed = bool((mask[0, token // 32] >> (token % 32)) & 1)
        assert allowed, f"xgrammar refused token {token}"
        assert matcher.accept_token(token)
    del torch
    return {"setup_s": setup, "compile_s": compile_s, "steps": steps, "finished": matcher.is_terminated()}


def run_llguidance(enc, vocab: list[bytes], eos: int, reply: list[int]) -> dict:
    import llguidance
    import llguidance.torch as lt
    from llguidance.tiktoken import lltokenizer_from_encoding

    t0 = time.perf_counter()
    tokenizer = lltokenizer_from_encoding(enc, n_vocab=len(vocab), eos_token=eos)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = lt.allocate_token_bitmask(1, len(vocab))
    steps = []
    for token in [*reply, eos]:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, mask, 0)
        steps.append(time.perf_counter() - t0)
        allowed = bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
        assert allowed, f"llguidance refused token {token}: {matcher.get_error()}"
        assert matcher.consume_token(token), matcher.get_error()
    return {"setup_s": setup, "compile_s": compile_s, "steps": steps, "finished": matcher.is_stopped()}


def run_outlines(vocab: list[bytes], eos: int, reply: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    tokens: dict[bytes, list[int]] = {}
    for i, piece in enumerate(vocab):
        if i != eos and piece:
            tokens.setdefault(piece, []).append(i)
    vocabulary = Vocabulary(eos, tokens)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), r""), vocabulary)
    compile_s = time.perf_counter() - t0
    guide = Guide(index)
    steps = []
    for token in reply:
        t0 = time.perf_counter()
        allowed = guide.get_tokens()
        steps.append(time.perf_counter() - t0)
        assert token in allowed, f"outlines-core refused token {token}"
        guide.advance(token)
    return {"setup_s": setup, "compile_s": compile_s, "steps": steps, "finished": guide.is_finished()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=Path, default=Path(".whl/qwen.tiktoken"))
    parser.add_argument("--out", default="grammar_libraries")
    args = parser.parse_args()
    ranks = load_ranks(args.vocab)
    vocab = [b""] * (len(ranks) + 1)
    for piece, rank in ranks.items():
        vocab[rank] = piece
    eos = len(ranks)
    enc = encoding(ranks)
    reply = enc.encode(json.dumps(INSTANCE, separators=(",", ":")))  # compact: no whitespace choices
    results = {}
    for name, fn in (("xgrammar", lambda: run_xgrammar(vocab, eos, reply)),
                     ("llguidance", lambda: run_llguidance(enc, vocab, eos, reply)),
                     ("outlines-core", lambda: run_outlines(vocab, eos, reply))):
        try:
            r = fn()
            r["median_step_us"] = statistics.median(r["steps"]) * 1e6
            r["max_step_us"] = max(r["steps"]) * 1e6
            r["steps"] = len(r["steps"])
            results[name] = r
        except Exception as e:  # noqa: BLE001 - one library failing still reports the others
            results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    out = Path(os.environ.get("OUT", "bench/results")) / f"{args.out}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"vocab": len(vocab), "reply_tokens": len(reply), "cpu": os.cpu_count(),
                               "results": results}, indent=2))
    print(f"vocabulary {len(vocab)} tokens · reply {len(reply)} tokens · {os.cpu_count()} CPUs")
    print(f"{'library':14} {'tokenizer setup s':>18} {'schema compile s':>17} {'mask median µs':>15} {'mask max µs':>12}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:14} failed: {r['error']}")
        else:
            print(f"{name:14} {r['setup_s']:18.2f} {r['compile_s']:17.3f} {r['median_step_us']:15.0f} "
                  f"{r['max_step_us']:12.0f}")


if __name__ == "__main__":
    main()
