"""What structured outputs cost per token on the GPU: JSON-schema-constrained decoding against
unconstrained decoding at batch 1 and 8, in the same run, through `TorchLLMEngine` as the app runs it.

Qwen2.5-7B shapes (random bf16 weights: speed does not depend on values) with the real 151,851-token
Qwen vocabulary (`qwen.tiktoken`), so each step's grammar mask is the size the app computes. The
constrained rows follow a schema of objects with strings, numbers, enums and arrays (llguidance, as
`pipeline.llm.text.grammar`); all rows sample with the UI's settings. Also a mixed batch (4 constrained +
4 not): what the unconstrained rows pay for sharing it.

    python bench/structured_decode.py --vocab .whl/qwen.tiktoken [--layers 28]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llm_engine import random_prompt, random_qwen25_7b  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.text.grammar import GrammarVocabulary, json_schema_grammar  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402
from pipeline.llm.text.tokenizer import QwenTiktokenTokenizer  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "maxLength": 60}, "mood": {"enum": ["happy", "sad", "calm"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "score": {"type": "number"}}, "required": ["name", "age", "email", "mood", "tags", "score"],
    "additionalProperties": False}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 50}  # long enough to fill every reply's tokens
TOKENS = 256
PARAMS = dict(max_new_tokens=TOKENS, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)


def run_batch(engine: TorchLLMEngine, vocabulary: GrammarVocabulary, constrained: list[bool], stop: set[int],
              tokenizer) -> dict:
    """Run len(constrained) requests at once; per-row tokens/s (from the first token on) and the batch's."""
    grammar = json_schema_grammar(SCHEMA)
    streams, results = [], {}
    start = time.perf_counter()
    for i, c in enumerate(constrained):
        streams.append(engine.submit(Prompt(random_prompt(100 + i, 64)), SamplingParams(**PARAMS, seed=i), stop,
                                     grammar=vocabulary.grammar(grammar, "bench") if c else None))

    def read(i: int) -> None:
        results[i] = list(streams[i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    rows = [{"constrained": c, "tokens": s.stats.new_tokens, "tok_s": s.stats.tokens_per_s,
             "finish": s.stats.finish_reason} for c, s in zip(constrained, streams)]
    for c, i in zip(constrained, range(len(streams))):
        if c:  # the JSON so far must be a prefix the schema allows: its text starts the array of objects
            text = tokenizer.decode(results[i])
            assert text.startswith("[{"), text[:80]
    return {"rows": rows, "wall_s": wall, "tokens": sum(r["tokens"] for r in rows)}


def median_tok_s(result: dict, constrained: bool) -> float:
    return statistics.median(r["tok_s"] for r in result["rows"] if r["constrained"] == constrained)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=Path, default=Path(".whl/qwen.tiktoken"))
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    shutil.copy(args.vocab, folder / "qwen.tiktoken")
    tokenizer = QwenTiktokenTokenizer(folder / "qwen.tiktoken")
    stop = tokenizer.eos_ids
    model = random_qwen25_7b(args.layers)
    engine = TorchLLMEngine(model, 2048, model.config.vocab_size, max_batch=8, rows=16)
    t0 = time.perf_counter()
    vocabulary = GrammarVocabulary(tokenizer, engine.vocab_size, stop)
    vocabulary_s = time.perf_counter() - t0
    run_batch(engine, vocabulary, [False] * 8, stop, tokenizer)  # warm: CUDA graphs for every bucket
    run_batch(engine, vocabulary, [True] * 8, stop, tokenizer)
    cases = {"b1 free": [False], "b1 json": [True], "b8 free": [False] * 8, "b8 json": [True] * 8,
             "b8 mixed": [True, False] * 4}
    measured: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so drift hits every case alike
        for name, constrained in cases.items():
            measured[name].append(run_batch(engine, vocabulary, constrained, stop, tokenizer))
    engine.close()

    def best(name: str, constrained: bool) -> float:
        return max(median_tok_s(r, constrained) for r in measured[name])

    def throughput(name: str) -> float:
        return max(r["tokens"] / r["wall_s"] for r in measured[name])

    summary = {
        "device": torch.cuda.get_device_name(), "layers": args.layers, "vocab": tokenizer.vocab_size,
        "grammar_vocabulary_build_s": vocabulary_s, "tokens_per_reply": TOKENS,
        "b1_free_tok_s": best("b1 free", False), "b1_json_tok_s": best("b1 json", True),
        "b8_free_tok_s_per_row": best("b8 free", False), "b8_json_tok_s_per_row": best("b8 json", True),
        "b8_free_throughput": throughput("b8 free"), "b8_json_throughput": throughput("b8 json"),
        "b8_mixed_free_rows_tok_s": best("b8 mixed", False), "b8_mixed_json_rows_tok_s": best("b8 mixed", True),
    }
    summary["b1_cost"] = summary["b1_free_tok_s"] / summary["b1_json_tok_s"] - 1
    summary["b8_cost"] = summary["b8_free_tok_s_per_row"] / summary["b8_json_tok_s_per_row"] - 1
    summary["b8_mixed_free_rows_cost"] = summary["b8_free_tok_s_per_row"] / summary["b8_mixed_free_rows_tok_s"] - 1
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "structured_decode.json").write_text(json.dumps({"summary": summary, "runs": measured}, indent=2))
    print(f"{summary['device']} · Qwen2.5-7B shapes ({args.layers} layers), vocabulary {tokenizer.vocab_size} · "
          f"grammar vocabulary built in {vocabulary_s:.2f} s")
    print(f"{'case':34} {'free tok/s':>11} {'json tok/s':>11} {'cost':>7}")
    print(f"{'batch 1':34} {summary['b1_free_tok_s']:11.1f} {summary['b1_json_tok_s']:11.1f} {summary['b1_cost']:7.1%}")
    print(f"{'batch 8 (per row)':34} {summary['b8_free_tok_s_per_row']:11.1f} {summary['b8_json_tok_s_per_row']:11.1f} "
          f"{summary['b8_cost']:7.1%}")
    print(f"{'batch 8 (all rows, tok/s)':34} {summary['b8_free_throughput']:11.1f} {summary['b8_json_throughput']:11.1f} "
          f"{summary['b8_free_throughput'] / summary['b8_json_throughput'] - 1:7.1%}")
    print(f"{'batch 8 mixed: unconstrained rows':34} {summary['b8_free_tok_s_per_row']:11.1f} "
          f"{summary['b8_mixed_free_rows_tok_s']:11.1f} {summary['b8_mixed_free_rows_cost']:7.1%}")


if __name__ == "__main__":
    main()
