"""The real SmolLM2 Q4_1 GGUF on this CPU (issue 50): our engine in float32, with the file's blocks as stored on
ONNX Runtime (`gguf`, `studio/onnx_llm.py`), with its float weights rounded to Q8_0 blocks there (`q8_0`: how image
chat runs a float decoder on the CPU) and with low-bit weights on torch's CPU kernels (`plugins/cpu_lowbit.py`),
against llama.cpp's `llama-bench` on the same file, in the same run.

Parts (`--parts`, comma-separated):
  decode      tg128 (greedy, batch 1, a short chat prompt), ours per weight mode and llama.cpp at each thread
              count up to the cores (its best kept), interleaved `--rounds` times; our resident memory after
              loading each mode (psutil, this process: one mode loaded at a time)
  perplexity  perplexity on `assets/eval_text.txt` (windows of 512) per weight mode, as the app loads them
  shapes      Q4_K_M files at Qwen2.5-1.5B's and 7B's shapes (`--shapes`; random F16 weights quantized by llama.cpp's
              own `llama-quantize`, its per-tensor rules): our ONNX Runtime engine (built once into an engine cache
              by a child process, then mapped from it here: its resident memory against the file) decoding tg128
              (greedy, batch 1, the decoder's steps), interleaved with llama-bench at each thread count
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
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.evaluate import score_text  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402
from pipeline.models import locate  # noqa: E402

MODEL_ID = "builtin/smollm2-135m-instruct"
# float32 first: the others are compared with it. q8_0: the file's weights in float rounded to Q8_0 blocks on ONNX
# Runtime, as image chat's float decoder runs on the CPU (`studio/onnx_llm.onnx_float_decoder`)
MODES = ("none", "gguf", "q8_0", "int4", "int8")
FLOAT_Q8 = "q8_0"
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


def float_q8_model(folder: Path):
    """`float_q8_decoder` as image chat's language model (`vlm_chat.language_model`)."""
    from pipeline.llm.model.loading import load_decoder
    from pipeline.llm.text.tokenizer import load_tokenizer
    from pipeline.pipelines.vlm_chat import language_model
    from studio.onnx_llm import onnx_float_decoder

    gguf = next(folder.glob("*.gguf")).resolve()
    return language_model(load_decoder(folder, dtype=torch.float32, device="cpu"), load_tokenizer(folder), MODEL_ID,
                          "cpu", 8192, 1, engine_of=lambda d: onnx_float_decoder(d, [gguf], MODEL_ID, engine_options()))


def decode_part(res: dict, rounds: int) -> None:
    from studio.backends import load_language_model

    folder = locate(MODEL_ID).path
    gguf = next(folder.glob("*.gguf")).resolve()
    res["file MB"] = round(gguf.stat().st_size / 1e6, 1)
    threads = range(1, (psutil.cpu_count(logical=False) or os.cpu_count() or 1) + 1)
    llama = {t: [] for t in threads}
    ours = {m: [] for m in MODES}
    subprocess.run([sys.executable, __file__, "--build", MODEL_ID], check=True)  # the first launch's engine build
    for mode in MODES:  # one mode loaded at a time: its resident memory is its own
        gc.collect()
        before = psutil.Process().memory_info().rss
        lm = float_q8_model(folder) if mode == FLOAT_Q8 else load_language_model(
            folder, MODEL_ID, "torch", "cpu", torch.float32, quant=mode, speculate="off", engines=engine_options())
        res[f"ours {mode}: resident MB after loading (more than before)"] = round(
            (psutil.Process().memory_info().rss - before) / 1e6, 1)
        res[f"ours {mode}: runs as"] = lm.description
        ours_tg128(lm)  # warm
        res[f"ours {mode}: resident MB after a 128-token reply"] = round(
            (psutil.Process().memory_info().rss - before) / 1e6, 1)
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
        if mode == FLOAT_Q8:
            lm = float_q8_model(folder)
            model, how = lm.engine.runner.model, lm.description
        else:
            model, how = torch_decoder(folder, MODEL_ID, mode, torch.float32, torch.device("cpu"), None)
        ppl = score_text(model.eval(), ids).perplexity
        base = base or ppl
        res[f"perplexity {mode} ({how})"] = round(ppl, 4)
        res[f"perplexity {mode} ÷ float"] = round(ppl / base, 4)
        del model


QWEN25_1_5B_DIMS = {"hidden": 1536, "ffn": 8960, "heads": 12, "kv": 2, "vocab": 151936}
SHAPES = {"1.5b": (QWEN25_1_5B_DIMS, 28), "7b": (None, 28)}  # 7B: gguf_native.QWEN25_7B_DIMS


def shape_file(name: str) -> Path:
    """The Q4_K_M file at `name`'s shapes, made once (F16 written with gguf-py, then `llama-quantize`)."""
    from gguf_native import QWEN25_7B_DIMS, WORK, write_model

    dims, layers = SHAPES[name]
    q4_k_m = WORK / f"qwen25-{name}-shape-Q4_K_M.gguf"
    if not q4_k_m.exists():
        WORK.mkdir(exist_ok=True)
        f16 = WORK / f"qwen25-{name}-shape-f16.gguf"
        write_model(f16, layers, c=dims or QWEN25_7B_DIMS, device="cpu")
        subprocess.run([str(LLAMA / "build/bin/llama-quantize"), str(f16), str(q4_k_m), "Q4_K_M"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        f16.unlink()
    return q4_k_m


ENGINES = Path("/tmp/gguf_bench/engines")  # the engine cache of these runs (a launch's `--engine-dir`)


def engine_options():
    """The engine cache, its lines on stderr."""
    from engine_builder.build import EngineOptions
    from engine_builder.cache import EngineCache

    class Say:
        def tell(self, line: str) -> None:
            print(line, file=sys.stderr)

        say = tell

    return EngineOptions(EngineCache(ENGINES), Say())


def load_engine(name: str):
    """Our ONNX Runtime decoder of `name`'s file (a shape's, or the built-in model's), from the engine cache."""
    from gguf_native import WORK, model_folder
    from studio.onnx_llm import onnx_gguf_decoder

    folder = locate(MODEL_ID).path if name == MODEL_ID else model_folder(shape_file(name), WORK / f"qwen25-{name}-folder")
    return onnx_gguf_decoder(folder, name, engine_options())[0]


def ours_steps(model, tokens: int = 128) -> float:
    """tg`tokens` of the decoder alone: greedy steps of one row after an 8-token prompt, tok/s."""
    from pipeline.llm.model.kv_cache import KVCache
    from pipeline.llm.model.parts import Prefill, Rows
    from pipeline.llm.model.rotary import RotaryTables

    cache = KVCache(model.config, 1, 256, torch.float32, "cpu")
    rope = RotaryTables(model.config, 256, "cpu")
    with torch.inference_mode():
        token = model(cache, rope, (Prefill(0, 0),), tokens=torch.arange(1, 9)[None])[0, -1].argmax().view(1, 1)
        start = time.perf_counter()
        for position in range(8, 8 + tokens):
            token = model(cache, rope, (Rows(torch.tensor([position]), torch.tensor([0]), 256),),
                          tokens=token)[0, -1].argmax().view(1, 1)
    return tokens / (time.perf_counter() - start)


def shapes_part(res: dict, names: list[str], rounds: int) -> None:
    threads = range(1, (psutil.cpu_count(logical=False) or 1) + 1)
    for name in names:
        gguf = shape_file(name)
        res[f"{name}: Q4_K_M file GB"] = round(gguf.stat().st_size / 1e9, 3)
        started = time.perf_counter()  # the build, in a child process (its working memory is not ours)
        subprocess.run([sys.executable, __file__, "--build", name], check=True)
        res[f"{name}: engine build s (first launch)"] = round(time.perf_counter() - started, 1)
        torch.set_num_threads(1)  # as the engine thread does: torch's spinning workers would take ONNX Runtime's cores
        gc.collect()
        before = psutil.Process().memory_info().rss
        model = load_engine(name)
        res[f"{name}: ours resident GB after loading"] = round((psutil.Process().memory_info().rss - before) / 1e9, 3)
        ours, llama = [], {t: [] for t in threads}
        ours_steps(model, 8)  # warm
        for _ in range(rounds):
            ours.append(ours_steps(model))
            for t in threads:
                llama[t].append(llama_tg128(gguf, t))
        res[f"{name}: ours resident GB after decoding"] = round((psutil.Process().memory_info().rss - before) / 1e9, 3)
        res[f"{name}: ours resident ÷ file"] = round(res[f"{name}: ours resident GB after decoding"] * 1e9
                                                     / gguf.stat().st_size, 3)
        best = max(threads, key=lambda t: statistics.median(llama[t]))
        res[f"{name}: llama.cpp tg128 tok/s by threads (median)"] = {t: round(statistics.median(v), 2)
                                                                      for t, v in llama.items()}
        res[f"{name}: ours tg128 tok/s (median of {rounds})"] = round(statistics.median(ours), 2)
        res[f"{name}: ours ÷ llama.cpp (its best threads)"] = round(statistics.median(ours)
                                                                    / statistics.median(llama[best]), 3)
        del model
        torch.set_num_threads(psutil.cpu_count(logical=False) or 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="decode,perplexity")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default="1.5b,7b")
    parser.add_argument("--build", help=argparse.SUPPRESS)  # the child process that builds a shape's engine
    args = parser.parse_args()
    if args.build:
        load_engine(args.build)
        return
    res = {"device": f"CPU, {psutil.cpu_count(logical=False)} cores", "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "torch threads": torch.get_num_threads(),
           "onnxruntime": __import__("onnxruntime").__version__}
    for part in args.parts.split(","):
        {"decode": lambda: decode_part(res, args.rounds), "perplexity": lambda: perplexity_part(res),
         "shapes": lambda: shapes_part(res, args.shapes.split(","), args.rounds)}[part]()
        report(OUT_NAME, res)


if __name__ == "__main__":
    main()
