"""A short prompt sent while a long one is being read, on this machine's CPU: both prompts' times to first
token with a lone prompt read in chunks (the engine now: 8 × the step budget of 128, so 1,024 tokens a
step) against each prompt read whole, in the same run; and a chunk's attention per layer, the old
function (SDPA over the materialised lower-right causal mask) against `plugins.chunk_attention`'s.

The real built-in model (SmolLM2-135M-Instruct, fp32, the app's serving path), fresh engines per mode: a
long prompt (`--long` tokens of the evaluation text, repeated) is read alone and timed to its first token
(`--repeats` times, the modes interleaved, the fastest kept); then it is submitted again and, `--after`
seconds later, "Say hi."; each first token is timed from its own submission. `--old` adds a mode reading
in chunks with the old attention function patched in.

    python bench/short_behind_long.py [--long 7000] [--after 2] [--repeats 2] [--old] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pipeline.llm.model.decoder as model_module  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.model.loading import load_decoder  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402
from pipeline.llm.text.tokenizer import load_tokenizer  # noqa: E402
from pipeline.models import locate  # noqa: E402
from plugins.chunk_attention import prefill_attention  # noqa: E402

MODEL_ID = "builtin/smollm2-135m-instruct"
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)
CHUNK = 1024  # what the engine reads of a lone prompt a step under its default budget (8 × 128)


def old_prefill_attention(q: Tensor, keys: Tensor, values: Tensor, start: int) -> Tensor:
    """plugins/chunk_attention.py before: SDPA with `causal_lower_right` (materialised on the CPU)."""
    mask = None if start == 0 else causal_lower_right(q.shape[2], keys.shape[2])
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=keys.shape[1] != q.shape[1])


def best_of(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def attention_per_layer(heads: int, kv_heads: int, head_dim: int, length: int) -> dict[str, float]:
    """One layer's attention in the engine's layout (q transposed from [1, T, heads, d], keys a slice of
    the cache): a chunk of 2,048 at the prompt's end; every chunk of the prompt summed; all causal at once."""
    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(1, kv_heads, length + 64, head_dim) for _ in range(2))
    q_all = torch.randn(1, length, heads, head_dim).transpose(1, 2)

    def chunk(fn: Callable, start: int, size: int = CHUNK) -> Callable[[], Tensor]:
        end = min(start + size, length)
        return lambda: fn(q_all[:, :, start:end], k_cache[:, :, :end], v_cache[:, :, :end], start)

    last, starts = length - CHUNK, range(0, length, CHUNK)
    res = {f"chunk {CHUNK} x {length} keys, old (masked)": best_of(chunk(old_prefill_attention, last)),
           f"chunk {CHUNK} x {length} keys, new (split + merge)": best_of(chunk(prefill_attention, last)),
           f"all chunks of {length}, old": sum(best_of(chunk(old_prefill_attention, s), 3) for s in starts),
           f"all chunks of {length}, new": sum(best_of(chunk(prefill_attention, s), 3) for s in starts),
           f"{length} causal in one call": best_of(chunk(prefill_attention, 0, length))}
    return {name: round(s, 3) for name, s in res.items()}


def first_token_s(stream) -> float:
    start = time.perf_counter()
    next(iter(stream))
    return time.perf_counter() - start


def engine(model, chunk: int | None, context: int, short_ids: list[int]) -> TorchLLMEngine:
    e = TorchLLMEngine(model, context, model.config.vocab_size, max_batch=4, prefill_chunk=chunk)
    list(e.submit(Prompt(tuple(short_ids[::-1])), GREEDY, set()))  # warm-up (not reused below)
    return e


def long_alone(model, chunk: int | None, long_ids: list[int], short_ids: list[int]) -> float:
    """The long prompt's first token with nothing else running (a fresh engine: no cached prefix)."""
    e = engine(model, chunk, len(long_ids) + 64, short_ids)
    try:
        stream = e.submit(Prompt(tuple(long_ids)), GREEDY, set())
        alone = first_token_s(stream)
        list(stream)
    finally:
        e.close()
    return alone


def short_behind_long(model, chunk: int | None, long_ids: list[int], short_ids: list[int], after: float) -> dict:
    """Both first tokens, each from its own submission, "Say hi." sent `after` s into the long one's read."""
    e = engine(model, chunk, len(long_ids) + 64, short_ids)
    try:
        found = {}
        long_stream = e.submit(Prompt(tuple(long_ids)), GREEDY, set())
        waiter = threading.Thread(target=lambda: found.setdefault("long", first_token_s(long_stream)))
        waiter.start()
        time.sleep(after)
        short = e.submit(Prompt(tuple(short_ids)), GREEDY, set())
        found["short"] = first_token_s(short)
        waiter.join()
        list(short)
        list(long_stream)
    finally:
        e.close()
    return {"short_first_token_s": round(found["short"], 2), "long_first_token_s": round(found["long"], 2)}


def with_attention(fn: Callable, run: Callable[[], object]):
    """`run()` with the model's prompt-chunk attention replaced by `fn`."""
    model_module.prefill_attention = fn
    try:
        return run()
    finally:
        model_module.prefill_attention = prefill_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", type=int, default=7000)
    ap.add_argument("--after", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=2, help="long-alone runs per mode (the fastest kept)")
    ap.add_argument("--old", action="store_true", help="also chunks of 2,048 with the old attention function")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    folder = locate(MODEL_ID).path
    tokenizer = load_tokenizer(folder)
    text = tokenizer.encode((ROOT / "assets" / "eval_text.txt").read_text())
    long_ids = (text * (args.long // len(text) + 1))[:args.long]
    short_ids = tokenizer.encode("Say hi.")
    model = load_decoder(folder).eval()
    c = model.config
    attention = attention_per_layer(c.num_heads, c.num_kv_heads, c.head_dim, args.long)

    modes = {f"chunks of {CHUNK} (now)": (CHUNK // 8, prefill_attention), "whole": (None, prefill_attention)}
    if args.old:
        modes[f"chunks of {CHUNK}, old attention"] = (CHUNK // 8, old_prefill_attention)
    alone: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every mode alike
        for name, (chunk, fn) in modes.items():
            alone[name].append(with_attention(fn, lambda: long_alone(model, chunk, long_ids, short_ids)))
    rows = {}
    for name, (chunk, fn) in modes.items():
        rows[name] = {"long_alone_first_token_s": round(min(alone[name]), 2),
                      "long_alone_runs_s": [round(s, 2) for s in alone[name]],
                      **with_attention(fn, lambda: short_behind_long(model, chunk, long_ids, short_ids, args.after))}
    whole = rows["whole"]["long_alone_first_token_s"]
    for row in rows.values():
        row["long_alone_vs_whole"] = round(row["long_alone_first_token_s"] / whole, 2)

    res = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "model": MODEL_ID, "dtype": "float32", "long_tokens": args.long, "short_sent_after_s": args.after,
           "repeats": args.repeats, "attention_per_layer_s": attention, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"SmolLM2-135M fp32, {args.long}-token prompt, 'Say hi.' {args.after} s later, {res['cores']} cores")
    for name, s in attention.items():
        print(f"  attention per layer, {name:42} {s:6.3f} s")
    for name, row in rows.items():
        print(f"{name:30} long alone: {row['long_alone_first_token_s']:6.2f} s ({row['long_alone_vs_whole']:.2f}× "
              f"whole)   with 'Say hi.': short {row['short_first_token_s']:6.2f} s, "
              f"long {row['long_first_token_s']:6.2f} s")


if __name__ == "__main__":
    main()
