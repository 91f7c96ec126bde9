"""Chunked prefill on the GPU: 7 chats decoding while an 8th joins with a 4,000-token prompt.

Qwen2.5-7B shapes, random bf16 weights (`llm_engine.random_qwen25_7b`), through `TorchLLMEngine` as
the app runs it (CUDA graphs, continuous batching, the pipelined decode step). Per mode (the prompt
read in chunks under a per-step budget of 256 tokens (the engine's default), 384 and 512, and whole
at once) on a fresh engine, after one untimed run of the same shapes that captures the graphs
(other prompts: nothing is reused):

- the largest gap between two consecutive tokens of a running chat while the 8th joins (from its
  submission to its last token), the median gap over the whole run (a decode step as a chat sees
  it), and their ratio (target with chunks: largest ≤ 2 × median); chat 0's gaps meanwhile; also the
  largest gap of the whole run and when it came (a decode graph captured for a batch and context
  bucket that the untimed run did not meet, as chats end, stalls a step too);
- the 8th chat's time to first token, and how many decode steps ran while its prompt was read;
- whether the greedy tokens of all 8 chats are the same in every mode: in bf16 at full depth, and in
  fp32 with 4 layers (the same widths). bf16 rounds differently wherever the kernels differ (a chunk's
  attention and its GEMMs' row counts; for the running chats the decode attention's context bucket,
  which grows when the 8th joins, a few steps later with chunks), so greedy replies of random weights
  part after a while; in fp32 they must not.

And with nothing decoding: a 20-token prompt sent while a 32,000-token prompt is read (in the engine's lone chunks
of 1,024, and of 2,048 under a budget of 256, against the prompt read whole): its time to first token as a multiple of one
chunk step (target ≤ 3), and the long prompt's own first token, chunked against whole.

Tokens are stamped on the engine thread as it hands them over (the stream's `deliver` wrapped), so no
consumer thread's scheduling is in the numbers.

The full run and `--short-only` take the app's default kernels: batch-invariant GEMMs for float weights on a GPU
(`--no-batch-invariant`: cuBLAS's).

With `--invariant-only`: the scenario in chunks of 128 with the default kernels and in batch-invariant mode
(`--batch-invariant`), their steps' times, and whether each mode's greedy bf16 replies alone = with the others.

With `--short-only`: only that 32k read, in the engine's attention tiles (`plugins.decode_attention.
prompt_tile_rows`) and, in the same run, in tiles of 64 rows (as before 2026-11-29).

    python bench/chunked_prefill.py [--layers 28] [--invariant-only | --short-only]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llm_engine import random_prompt, random_qwen25_7b  # noqa: E402
from timing import report  # noqa: E402
from plugins import decode_attention  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.model.invariant import make_batch_invariant  # noqa: E402
from pipeline.llm.engine.seam import TokenStream  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402

CHATS, CHAT_PROMPT, LONG_PROMPT = 7, 128, 4000
WARM_TOKENS = 16  # tokens each running chat has received before the 8th joins
RUNNING = SamplingParams(max_new_tokens=160, temperature=0, repetition_penalty=1.0)
JOINING = SamplingParams(max_new_tokens=32, temperature=0, repetition_penalty=1.0)
MODES = (("chunks of 128", 128), ("chunks of 256", 256), ("whole prompt", None))


def stamped(stream: TokenStream) -> list[float]:
    """The times at which the engine thread hands `stream` its tokens (from now on)."""
    times: list[float] = []
    deliver = stream.deliver

    def stamp(item: int | BaseException) -> None:
        times.append(time.perf_counter())
        deliver(item)

    stream.deliver = stamp
    return times


def scenario(engine: TorchLLMEngine, seed: int) -> dict:
    """7 chats decode; once each has WARM_TOKENS tokens the 8th submits its long prompt. The join window
    runs from its submission to its last token (32 steps after its first, all 8 decoding)."""
    chats = [engine.submit(Prompt(random_prompt(seed + i, CHAT_PROMPT)), RUNNING, set()) for i in range(CHATS)]
    times = [stamped(s) for s in chats]
    readers = [iter(s) for s in chats]
    tokens = [[next(r) for _ in range(WARM_TOKENS)] for r in readers]
    submitted = time.perf_counter()
    joining = engine.submit(Prompt(random_prompt(seed + 100, LONG_PROMPT)), JOINING, set())
    joined = stamped(joining)
    tokens.append(list(joining))
    for mine, reader in zip(tokens, readers):
        mine += list(reader)
    gaps = [(b - a, a) for t in times for a, b in zip(t[WARM_TOKENS:], t[WARM_TOKENS + 1:])]
    median = statistics.median(g for g, _ in gaps)
    joining_gap = max(g for g, a in gaps if submitted <= a <= joined[-1])
    largest, at = max(gaps)
    return {"largest_gap_while_joining_ms": round(joining_gap * 1e3, 2), "median_step_ms": round(median * 1e3, 2),
            "ratio": round(joining_gap / median, 2),
            "joining_ttft_ms": round(joining.stats.time_to_first_token_s * 1e3, 1),
            "chat_tokens_while_prompt_read": sum(submitted < t < joined[0] for t in times[0]),
            "chat0_gaps_while_joining_ms": [round((b - a) * 1e3, 2) for a, b in zip(times[0], times[0][1:])
                                            if submitted - 0.02 < a < joined[0] + 0.05],
            "largest_gap_of_the_run_ms": round(largest * 1e3, 2),
            "largest_gap_of_the_run_at_ms_after_submission": round((at - submitted) * 1e3, 1),
            "tokens": tokens}


SHORT, LONGEST = 20, 32000


def short_behind_long(model, chunk: int | None) -> dict:
    """A 32,000-token prompt, nothing else running; once 4 of its chunks (or steps) have run, a 20-token one."""
    steps: list[float] = []
    with torch.inference_mode():
        engine = TorchLLMEngine(model, LONGEST + 64, model.config.vocab_size, max_batch=8, rows=2, prefill_chunk=chunk)
        run = engine.runner.step

        def timed(*args, **kwargs):  # the engine keeps one step ahead of the GPU: steps end a step's time apart
            out = run(*args, **kwargs)
            steps.append(time.perf_counter())
            return out

        engine.runner.step = timed
        # warm-up, other tokens, as deep as the long tile starts (`decode_attention.DEEP`), a short one joining: every
        # attention tile's kernels compile now (the app compiles them as it starts: `plugins.precompile`)
        warm = engine.submit(Prompt(random_prompt(7, decode_attention.DEEP + 2048)), JOINING, set())
        while len(steps) < 2 and not warm.stats.time_to_first_token_s:
            time.sleep(0.001)
        list(engine.submit(Prompt(random_prompt(6, SHORT)), JOINING, set()))
        list(warm)
        steps.clear()
        started = time.perf_counter()
        long = engine.submit(Prompt(random_prompt(8, LONGEST)), JOINING, set())
        while len(steps) < (4 if chunk else 0) and not long.stats.time_to_first_token_s:
            time.sleep(0.001)
        joined = time.perf_counter()
        short = engine.submit(Prompt(random_prompt(9, SHORT)), JOINING, set())
        list(short)
        list(long)
        engine.close()
    chunk_steps = [b - a for a, b in zip(steps[2:], steps[3:6])]  # the steps around the short one's joining
    one_step = statistics.median(chunk_steps) if chunk_steps else None
    return {"short_ttft_ms": round(short.stats.time_to_first_token_s * 1e3, 1),
            "step_ms_median_max_and_all": [round(statistics.median(gaps) * 1e3, 1), round(max(gaps) * 1e3, 1),
                                           [round(g * 1e3, 1) for g in gaps]] if (gaps := [
                                               b - a for a, b in zip(steps, steps[1:])]) else None,
            "steps_returned_ms_from_short_submission": [round((t - joined) * 1e3, 1) for t in steps
                                                        if -0.1 < t - joined < short.stats.time_to_first_token_s + 0.1],
            "long_ttft_ms": round(long.stats.time_to_first_token_s * 1e3, 1),
            "chunk_step_ms": round(one_step * 1e3, 1) if one_step else None,
            "short_ttft_in_chunk_steps": round(short.stats.time_to_first_token_s / one_step, 2) if one_step else None,
            "wall_s": round(time.perf_counter() - started, 2)}


def measured(model, chunk: int | None, seed: int = 0) -> tuple[dict, list[list[int]]]:
    """The scenario's numbers and every chat's tokens on a fresh engine, after one run that captures the
    graphs of every batch and context bucket."""
    with torch.inference_mode():
        engine = TorchLLMEngine(model, 8192, model.config.vocab_size, max_batch=8, rows=8, prefill_chunk=chunk)
        scenario(engine, seed=seed + 1000)
        gc.collect()
        numbers = scenario(engine, seed=seed)
        engine.close()
    return numbers, numbers.pop("tokens")


def alone(model, chunk: int | None, seed: int = 0) -> list[list[int]]:
    """The scenario's 8 prompts each read and answered with no other chat running, one after another."""
    with torch.inference_mode():
        engine = TorchLLMEngine(model, 8192, model.config.vocab_size, max_batch=8, rows=8, prefill_chunk=chunk)
        out = [list(engine.submit(Prompt(random_prompt(seed + i, CHAT_PROMPT)), RUNNING, set())) for i in range(CHATS)]
        out.append(list(engine.submit(Prompt(random_prompt(seed + 100, LONG_PROMPT)), JOINING, set())))
        engine.close()
    return out


def first_difference(x: list[int], y: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))


def agreement(res: dict, tokens: dict, same: str, matching: str) -> None:
    """Per chunked mode: whether every chat's tokens equal the whole-prompt mode's, and how many do."""
    reference = tokens["whole prompt"]
    for name, _ in MODES[:-1]:
        res[name][same] = tokens[name] == reference
        res[name][matching] = [first_difference(x, y) for x, y in zip(tokens[name], reference)]


def invariant(model, seed: int) -> dict:
    """The scenario in chunks of 128 with the default kernels, then in batch-invariant mode (the model switched in
    place): its numbers beside the default's, and whether each mode's greedy replies alone = with the others."""
    out = {}
    for name in ("default", "batch-invariant"):
        if name == "batch-invariant":
            assert make_batch_invariant(model) is None
        numbers, tokens = measured(model, MODES[0][1], seed)
        lone = alone(model, MODES[0][1], seed)
        out[name] = {**{k: v for k, v in numbers.items() if not k.startswith("chat0")},
                     "greedy_identical_alone_vs_together": lone == tokens,
                     "tokens_matching_per_chat": [first_difference(x, y) for x, y in zip(lone, tokens)]}
    out["median_step_ratio"] = round(out["batch-invariant"]["median_step_ms"] / out["default"]["median_step_ms"], 3)
    out["joining_ttft_ratio"] = round(out["batch-invariant"]["joining_ttft_ms"] / out["default"]["joining_ttft_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--invariant-only", action="store_true",
                    help="only the batch-invariant comparison (chunks of 128, default kernels against invariant ones)")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' seed (--invariant-only)")
    ap.add_argument("--no-batch-invariant", action="store_true",
                    help="the full run or --short-only with cuBLAS's GEMMs (the app's --no-batch-invariant; "
                         "else its default)")
    ap.add_argument("--short-only", action="store_true",
                    help="only the 20-token prompt behind a 32k read, the engine's attention tiles and, in the same "
                         "run, tiles of 64 rows (as before 2026-11-29)")
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "shapes": f"Qwen2.5-7B ({args.layers} layers), bf16, random weights", "chats": CHATS,
                 "joining_prompt_tokens": LONG_PROMPT}
    model = random_qwen25_7b(args.layers)
    if args.invariant_only:
        res["seed"] = args.seed
        res["invariant"] = inv = invariant(model, args.seed)
        report("chunked_prefill_invariant", res)
        print(f"\n{res['device']} · {res['shapes']} · {CHATS} chats decoding, an 8th joins with {LONG_PROMPT} tokens "
              f"(chunks of {MODES[0][1]})")
        for name in ("default", "batch-invariant"):
            m = inv[name]
            print(f"{name:16s} median step {m['median_step_ms']:6.2f} ms  largest gap {m['largest_gap_while_joining_ms']:6.2f} ms"
                  f"  8th TTFT {m['joining_ttft_ms']:7.1f} ms  greedy alone = together: "
                  f"{m['greedy_identical_alone_vs_together']} {m['tokens_matching_per_chat']}")
        print(f"batch-invariant / default: median step {inv['median_step_ratio']}×, 8th TTFT {inv['joining_ttft_ratio']}×")
        return
    kernels = "cuBLAS (--no-batch-invariant)" if args.no_batch_invariant else "batch-invariant (the app's default)"
    res["kernels"] = kernels
    if not args.no_batch_invariant:
        assert make_batch_invariant(model) is None
    if args.short_only:
        res["short_behind_long"] = {}
        kept = decode_attention.TILE_ROWS, decode_attention.prompt_tile_rows
        for tiles in ("the engine's tiles", "tiles of 64 rows (before 2026-11-29)"):
            if tiles.startswith("tiles of 64"):  # the runner lays chunks out in runs of 18 queries: two tiles of 9
                decode_attention.TILE_ROWS, decode_attention.prompt_tile_rows = 64, lambda tokens, start: 64
            for name, chunk in (("lone chunks of 1024", 128), ("lone chunks of 2048", 256), ("whole prompt", None)):
                res["short_behind_long"][f"{name}, {tiles}"] = short_behind_long(model, chunk)
        decode_attention.TILE_ROWS, decode_attention.prompt_tile_rows = kept
        report("chunked_prefill_short", res)
        print_short(res)
        return
    tokens = {}
    for name, chunk in MODES:
        res[name], tokens[name] = measured(model, chunk)
    agreement(res, tokens, "greedy_tokens_identical_to_whole", "tokens_matching_whole_per_chat")
    lone = alone(model, MODES[0][1])  # the same prompts with no other chat running: the same greedy replies?
    res["alone_vs_together"] = {"greedy_identical": lone == tokens[MODES[0][0]],
                                "tokens_matching_per_chat": [first_difference(x, y) for x, y in
                                                             zip(lone, tokens[MODES[0][0]])],
                                "tokens_per_chat": [len(x) for x in lone]}
    res["short_behind_long"] = {name: short_behind_long(model, chunk) for name, chunk in
                                (("lone chunks of 1024", 128), ("lone chunks of 2048", 256), ("whole prompt", None))}
    report("chunked_prefill", res)
    del model
    fp32 = random_qwen25_7b(4).float()
    if not args.no_batch_invariant:
        assert make_batch_invariant(fp32) is None
    tokens = {name: measured(fp32, chunk)[1] for name, chunk in MODES}
    agreement(res, tokens, "fp32_4_layers_greedy_identical_to_whole", "fp32_4_layers_tokens_matching_whole")
    report("chunked_prefill", res)
    print(f"\n{res['device']} · {res['shapes']} · {kernels} · {CHATS} chats decoding, an 8th joins with "
          f"{LONG_PROMPT} tokens")
    print(f"{'mode':15s} {'largest gap':>12s} {'median step':>12s} {'ratio':>6s} {'8th TTFT':>10s} "
          f"{'steps while read':>17s} {'greedy = whole: bf16':>21s} {'fp32':>6s}")
    for name, _ in MODES:
        m = res[name]
        print(f"{name:15s} {m['largest_gap_while_joining_ms']:10.2f}ms {m['median_step_ms']:10.2f}ms {m['ratio']:6.2f} "
              f"{m['joining_ttft_ms']:8.1f}ms {m['chat_tokens_while_prompt_read']:17d} "
              f"{str(m.get('greedy_tokens_identical_to_whole', '-')):>21s} "
              f"{str(m.get('fp32_4_layers_greedy_identical_to_whole', '-')):>6s}")
    together = res["alone_vs_together"]
    print(f"\ngreedy bf16 replies alone = with the other chats ({MODES[0][0]}): {together['greedy_identical']} "
          f"(tokens matching per chat {together['tokens_matching_per_chat']} of {together['tokens_per_chat']})")
    print_short(res)


def print_short(res: dict) -> None:
    print(f"\na {SHORT}-token prompt sent while a {LONGEST}-token one is read, nothing else running")
    for name, m in res["short_behind_long"].items():
        print(f"{name:36s} short TTFT {m['short_ttft_ms']:8.1f}ms  long TTFT {m['long_ttft_ms']:8.1f}ms  "
              f"chunk step {m['chunk_step_ms']}ms  short TTFT in chunk steps {m['short_ttft_in_chunk_steps']}")


if __name__ == "__main__":
    main()
