"""A GGUF file's tokenizer, written as the `tokenizer.json` + `tokenizer_config.json` +
`generation_config.json` that `tokenizer.HFTokenizer` reads, so GGUF models tokenize, stream and
template exactly as transformers folders do.

The file's metadata holds the vocabulary in one of two kinds (`tokenizer.ggml.model`):
- `gpt2`: byte-level BPE with its merges; `tokenizer.ggml.pre` names the pre-tokenizer, whose
  regular expressions are llama.cpp's (`llama-vocab.cpp`), so the splits are the file's own.
- `llama`: SentencePiece pieces with scores and `<0xNN>` byte pieces; run as byte-fallback BPE whose
  merges rank by the merged piece's score (what transformers' fast LLaMA tokenizers do).
Token types (llama.cpp's): 3 control tokens are special; 4 user-defined ones are added tokens.
It lives with the other GGUF readers in `weights/`: the text layer below only reads the files it writes.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.errors import UserError
from pipeline.llm.text.tokenizer import QWEN_PAT_STR
from pipeline.llm.weights.gguf_file import GGUFModel

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PAT = (r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
              r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# `tokenizer.ggml.pre` → the regular expressions applied one after another (llama.cpp's table)
PRE_TOKENIZERS = {
    "default": [GPT2_PAT], "gpt-2": [GPT2_PAT],
    "smollm": [r"\p{N}", r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""],
    "qwen2": [QWEN_PAT_STR], "llama-bpe": [LLAMA3_PAT], "llama3": [LLAMA3_PAT],
}
CONTROL, USER_DEFINED = 3, 4


def _tokens(model: GGUFModel) -> tuple[list[str], list[int]]:
    tokens = model.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise UserError(f"{model.path.name} has no tokenizer (tokenizer.ggml.tokens) in its metadata")
    types = model.metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise UserError(f"{model.path.name}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    return [str(t) for t in tokens], [int(t) for t in types]


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def _gpt2(model: GGUFModel, tokens: list[str]) -> dict[str, Any]:
    pre = str(model.metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise UserError(f"{model.path.name} uses the {pre!r} pre-tokenizer, which this app does not implement "
                        f"(it does {', '.join(PRE_TOKENIZERS)})")
    merges = model.metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise UserError(f"{model.path.name}: a BPE tokenizer without tokenizer.ggml.merges")
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            *map(_split, PRE_TOKENIZERS[pre]),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": [str(m) for m in merges]},
    }


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[str]:
    """BPE merges equivalent to SentencePiece's score order: every split of a piece into two pieces
    of the vocabulary, the merged piece's score first (ties: the earlier left, then right piece)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-score, ids[left], ids[right], f"{left} {right}"))
    return [merge for *_, merge in sorted(found)]


def _sentencepiece(model: GGUFModel, tokens: list[str]) -> dict[str, Any]:
    scores = [float(s) for s in model.metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    unk = model.metadata.get("tokenizer.ggml.unknown_token_id")
    prefix = bool(model.metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = ([{"type": "Prepend", "prepend": "\u2581"}] if prefix else []) + \
        [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    decoders = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}] + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])
    return {
        "normalizer": {"type": "Sequence", "normalizers": steps},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk] if unk is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": _sentencepiece_merges(tokens, scores)},
    }


def tokenizer_files(model: GGUFModel) -> dict[str, dict[str, Any]]:
    """{file name: JSON content} of the three tokenizer files for the model in `model`."""
    tokens, types = _tokens(model)
    kind = model.metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        spec = _gpt2(model, tokens)
    elif kind == "llama":
        spec = _sentencepiece(model, tokens)
    else:
        raise UserError(f"{model.path.name} has a {kind!r} tokenizer; this app reads GGUF's 'gpt2' (byte-level BPE) "
                        f"and 'llama' (SentencePiece) tokenizers")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": kind_ == CONTROL} for i, (t, kind_) in enumerate(zip(tokens, types))
             if kind_ in (CONTROL, USER_DEFINED)]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                 "post_processor": None, **spec}

    def named(key: str) -> str | None:
        i = model.metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "add_bos_token": bool(model.metadata.get("tokenizer.ggml.add_bos_token",
                                                                       kind == "llama"))}
    for key in ("bos", "eos", "unknown", "padding"):
        if named(key) is not None:
            config[{"unknown": "unk_token", "padding": "pad_token"}.get(key, f"{key}_token")] = named(key)
    template = model.metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    stops = [model.metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    generation = {"eos_token_id": sorted({int(i) for i in stops if i is not None})}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config, "generation_config.json": generation}


def write_tokenizer_files(model: GGUFModel, folder) -> None:
    for name, content in tokenizer_files(model).items():
        (folder / name).write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
