"""A short prompt sent while a long one is being read, on this machine's CPU: its time to first token, with
prompts read in shared chunks (the engine's default budget) against each prompt read whole (the engine
before issue 41's fair chunks read a prompt whole when nothing else was decoding), in the same run.

The real built-in model (SmolLM2-135M-Instruct, fp32, the app's serving path), an engine per mode: a long
prompt (`--long` tokens of the evaluation text, repeated) is submitted, then, `--after` seconds later,
"Say hi."; the short one's first token is timed from its submission, the long one's from its own.

    python bench/short_behind_long.py [--long 7000] [--after 2] [--out bench/results/short_behind_long.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.llm.engine.sampling import SamplingParams  # noqa: E402
from pipeline.llm.engine.seam import Prompt  # noqa: E402
from pipeline.models import locate  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.weights.checkpoint import load_decoder  # noqa: E402

MODEL_ID = "builtin/smollm2-135m-instruct"
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


def first_token_s(stream) -> float:
    start = time.perf_counter()
    next(iter(stream))
    return time.perf_counter() - start


def one_mode(model, chunk: int | None, long_ids: list[int], short_ids: list[int], after: float) -> dict:
    engine = TorchLLMEngine(model, len(long_ids) + 64, model.config.vocab_size, max_batch=4, prefill_chunk=chunk)
    try:
        list(engine.submit(Prompt(tuple(short_ids[::-1])), GREEDY, set()))  # warm-up (not reused below)
        found = {}
        long_stream = engine.submit(Prompt(tuple(long_ids)), GREEDY, set())
        waiter = threading.Thread(target=lambda: found.setdefault("long", first_token_s(long_stream)))
        waiter.start()
        time.sleep(after)
        short = engine.submit(Prompt(tuple(short_ids)), GREEDY, set())
        found["short"] = first_token_s(short)
        waiter.join()
        list(short)
        list(long_stream)
    finally:
        engine.close()
    return {"short_first_token_s": round(found["short"], 2), "long_first_token_s": round(found["long"] + after, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", type=int, default=7000)
    ap.add_argument("--after", type=float, default=2.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from pipeline.llm.text.tokenizer import load_tokenizer

    folder = locate(MODEL_ID).path
    tokenizer = load_tokenizer(folder)
    text = tokenizer.encode((ROOT / "assets" / "eval_text.txt").read_text())
    long_ids = (text * (args.long // len(text) + 1))[:args.long]
    short_ids = tokenizer.encode("Say hi.")
    model = load_decoder(folder).eval()
    rows = {"whole (before)": one_mode(model, None, long_ids, short_ids, args.after),
            "shared chunks of 256": one_mode(model, 256, long_ids, short_ids, args.after)}
    res = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "long_tokens": args.long,
           "short_sent_after_s": args.after, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    print(f"SmolLM2-135M fp32, {args.long}-token prompt, 'Say hi.' {args.after} s later, {res['cores']} cores")
    for name, row in rows.items():
        print(f"{name:22} short: first token {row['short_first_token_s']:6.2f} s   long: {row['long_first_token_s']:6.2f} s")


if __name__ == "__main__":
    main()
