"""The real SmolLM2 Q4_1 GGUF on this CPU (issue 50): our engine in float32, with the file's blocks as stored on
ONNX Runtime (`gguf`, `studio/onnx_llm.py`) and with low-bit weights on torch's CPU kernels (`plugins/cpu_lowbit.py`), against llama.cpp's `llama-bench` on the same file, in the same run.

Parts (`--parts`, comma-separated):
  decode      tg128 (greedy, batch 1, a short chat prompt), ours per weight mode and llama.cpp at each thread
              count up to the cores (its best kept), interleaved `--rounds` times; our resident memory after
              loading each mode (psutil, this process: one mode loaded at a time)
  perplexity  perplexity on `assets/eval_text.txt` (windows of 512) per weight mode, as the app loads them
    bash bench/llamacpp.sh build .bench/carry/llama.cpp-src.tar.gz /tmp/llamacpu cpu
    LLAMA_DIR=/tmp/llamacpu python bench/cpu_lowbit.py --parts decode,perplexity
Writes cpu_lowbit.json to $OUT (default bench/results); prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from timing import report  # noqa: E402
from pipeline.llm.engine.sampling import SamplingParams  # noqa: E402
from pipeline.llm.evaluate import score_text  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402
from pipeline.models import locate  # noqa: E402

MODEL_ID = "builtin/smollm2-135m-instruct"
MODES = ("none", "gguf", "int4", "int8")  # float32 first: the others are compared with it
LLAMA = Path(os.environ.get("LLAMA_DIR", "/tmp/llamacpu"))
OUT_NAME = "cpu_lowbit"


def llama_tg128(gguf: Path, threads: int) -> float:
    done = subprocess.run([str(LLAMA / "build/bin/llama-bench"), "-m", str(gguf), "-p", "0", "-n", "128", "-t",
                           str(threads), "-r", "3", "-o", "json"], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)[0]["avg_ts"]


def ours_tg128(lm) -> float:
    ids = lm.format.render([{"role": "user", "content": "Write a short story about a lighthouse keeper."}]).ids
    for i in range(len(lm.engine.rows)):  # each run prefills its prompt, as a first turn does
        lm.engine.rows.forget(i)
    stream = lm.engine.submit(Prompt(ids), SamplingParams(max_new_tokens=128, temperature=0,
                                                          repetition_penalty=1.0), stop_ids=set())
    assert len(list(stream)) == 128
    return stream.stats.tokens_per_s


def decode_part(res: dict, rounds: int) -> None:
    from studio.backends import load_language_model

    folder = locate(MODEL_ID).path
    gguf = next(folder.glob("*.gguf")).resolve()
    res["file MB"] = round(gguf.stat().st_size / 1e6, 1)
    threads = range(1, (psutil.cpu_count(logical=False) or os.cpu_count() or 1) + 1)
    llama = {t: [] for t in threads}
    ours = {m: [] for m in MODES}
    for mode in MODES:  # one mode loaded at a time: its resident memory is its own
        gc.collect()
        before = psutil.Process().memory_info().rss
        lm = load_language_model(folder, MODEL_ID, "torch", "cpu", torch.float32, quant=mode, speculate="off")
        res[f"ours {mode}: resident MB after loading (more than before)"] = round(
            (psutil.Process().memory_info().rss - before) / 1e6, 1)
        res[f"ours {mode}: runs as"] = lm.description
        ours_tg128(lm)  # warm
        for _ in range(rounds):  # interleaved with llama.cpp's runs, so a busy moment hits both
            ours[mode].append(ours_tg128(lm))
            for t in threads:
                llama[t].append(llama_tg128(gguf, t))
        lm.close()
        del lm
    best_t = max(threads, key=lambda t: statistics.median(llama[t]))
    res["llama.cpp tg128 tok/s by threads (median)"] = {t: round(statistics.median(v), 1) for t, v in llama.items()}
    res["llama.cpp threads (best)"] = best_t
    anchor = statistics.median(llama[best_t])
    for mode in MODES:
        median = statistics.median(ours[mode])
        res[f"ours {mode} tg128 tok/s (median of {rounds})"] = round(median, 1)
        res[f"ours {mode} ÷ llama.cpp"] = round(median / anchor, 3)


def perplexity_part(res: dict) -> None:
    from studio.backends import torch_decoder

    folder = locate(MODEL_ID).path
    from pipeline.llm.text.tokenizer import load_tokenizer

    ids = load_tokenizer(folder).encode((ROOT / "assets" / "eval_text.txt").read_text())
    base = None
    for mode in MODES:
        model, how = torch_decoder(folder, MODEL_ID, mode, torch.float32, torch.device("cpu"), None)
        ppl = score_text(model.eval(), ids).perplexity
        base = base or ppl
        res[f"perplexity {mode} ({how})"] = round(ppl, 4)
        res[f"perplexity {mode} ÷ float"] = round(ppl / base, 4)
        del model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="decode,perplexity")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    res = {"device": f"CPU, {psutil.cpu_count(logical=False)} cores", "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "torch threads": torch.get_num_threads(),
           "onnxruntime": __import__("onnxruntime").__version__}
    for part in args.parts.split(","):
        {"decode": lambda: decode_part(res, args.rounds), "perplexity": lambda: perplexity_part(res)}[part]()
        report(OUT_NAME, res)


if __name__ == "__main__":
    main()
