"""The LLM engine on the GPU: batch-1 decode against the memory roofline, 8 chats at once, and the
time to first token deep in a conversation — all in one run, ratios printed last.

Qwen2.5-7B shapes (GQA 28/4, qkv bias, vocab 152064), random bf16 weights (speed does not depend on
values), through `TorchLLMEngine` as the app runs it (CUDA graphs, continuous batching).
Roofline = weight bytes read per token (all but the embedding table) / copy bandwidth measured now.

    python bench/llm_engine.py [--layers 28]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import copy_bandwidth_tbps  # noqa: E402
from pipeline.llm.weights.config import config_from_hf  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.model.decoder import Decoder  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
QWEN25_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "max_position_embeddings": 32768, "rope_theta": 1e6, "tie_word_embeddings": False}
GREEDY = SamplingParams(max_new_tokens=256, temperature=0, repetition_penalty=1.0)
UI_DEFAULT = SamplingParams(max_new_tokens=256, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, seed=0)


def random_qwen25_7b(layers: int = 28) -> Decoder:
    """Qwen2.5-7B's shapes with random bf16 weights on the GPU."""
    with torch.device("meta"):
        model = Decoder(config_from_hf({**QWEN25_7B, "num_hidden_layers": layers}))
    model = model.to_empty(device="cuda").to(torch.bfloat16).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.02)
    return model


def random_prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 150000, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def run(engine, prompt: tuple[int, ...], params: SamplingParams, session: str | None = None):
    stream = engine.submit(Prompt(prompt), params, stop_ids=set(), session=session)
    tokens = list(stream)
    return tokens, stream.stats


def concurrent(engine, n: int, params: SamplingParams) -> dict:
    start = time.perf_counter()
    streams = [engine.submit(Prompt(random_prompt(100 + i, 128)), params, stop_ids=set()) for i in range(n)]
    for s in streams:
        s.wait()
    wall = time.perf_counter() - start
    total = sum(s.stats.new_tokens for s in streams)
    return {"aggregate_tok_s": round(total / wall, 1), "wall_s": round(wall, 3),
            "per_chat_tok_s": [round(s.stats.tokens_per_s, 1) for s in streams],
            "ttft_ms": [round(s.stats.time_to_first_token_s * 1e3, 1) for s in streams]}


def conversation(engine, session: str, turns: int = 5, user_tokens: int = 200, reply_tokens: int = 550) -> list[dict]:
    """A chat of `turns` turns in one session: each prompt is the last one, its reply and a new message."""
    history: tuple[int, ...] = ()
    out = []
    for turn in range(turns):
        prompt = history + random_prompt(1000 * turn + sum(map(ord, session)), user_tokens)
        reply, stats = run(engine, prompt, SamplingParams(max_new_tokens=reply_tokens, temperature=0,
                                                          repetition_penalty=1.0), session)
        out.append({"turn": turn + 1, "prompt_tokens": stats.prompt_tokens, "prefilled": stats.prefilled_tokens,
                    "ttft_ms": round(stats.time_to_first_token_s * 1e3, 2)})
        history = prompt + tuple(reply)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    model = random_qwen25_7b(args.layers)
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - model.embed.weight.nbytes
    res["copy_TBps"] = round(copy_bandwidth_tbps(), 3)
    res["roofline_tok_s"] = round(res["copy_TBps"] * 1e12 / weight_bytes, 1)
    engine = TorchLLMEngine(model, 8192, config.vocab_size, max_batch=8, rows=16)

    with torch.inference_mode():
        prompt = random_prompt(1, 128)
        for params, key in ((GREEDY, "greedy"), (UI_DEFAULT, "ui_sampling")):
            run(engine, prompt, params)  # captures this length's graphs
            res[f"batch1_{key}_tok_s"] = round(statistics.median(run(engine, prompt, params)[1].tokens_per_s
                                                                 for _ in range(3)), 1)
        alone, _ = run(engine, prompt, GREEDY)
        for n in (2, 4, 8):
            concurrent(engine, n, GREEDY)  # captures the batch bucket's graphs
            res[f"concurrent{n}_greedy"] = concurrent(engine, n, GREEDY)
        concurrent(engine, 8, UI_DEFAULT)
        res["concurrent8_ui_sampling"] = concurrent(engine, 8, UI_DEFAULT)
        # bf16 batch rows round differently from a batch-1 GEMV: report how long greedy agrees.
        streams = [engine.submit(Prompt(prompt), GREEDY, stop_ids=set())] + [
            engine.submit(Prompt(random_prompt(200 + i, 128)), GREEDY, stop_ids=set()) for i in range(7)]
        batched = list(streams[0])
        for s in streams[1:]:
            s.wait()
        res["batched_vs_alone_greedy_prefix_match_of_256"] = next(
            (i for i, (a, b) in enumerate(zip(alone, batched)) if a != b), 256)
        conversation(engine, "warm-up", turns=2)
        chats = [conversation(engine, f"chat{i}") for i in range(2)]
        res["conversation"] = chats
        ttft = [max(c[t]["ttft_ms"] for c in chats) for t in range(5)]  # the worse of the two chats
        res["ttft_ms_by_turn"] = ttft
        fifth = chats[0][4]
        # The same turn-5 prompt without reuse (a new session): what every turn cost before.
        history_prompt = random_prompt(7, fifth["prompt_tokens"])
        run(engine, history_prompt, SamplingParams(max_new_tokens=1, temperature=0), "fresh-warm")
        res["ttft_ms_turn5_full_prefill"] = round(statistics.median(
            run(engine, history_prompt, SamplingParams(max_new_tokens=1, temperature=0), None)[1]
            .time_to_first_token_s * 1e3 for _ in range(3)), 2)
    engine.close()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "llm_engine.json").write_text(json.dumps(res, indent=1))

    one = res["batch1_greedy_tok_s"]
    rows = [
        ("device / date", f"{res['device']} / {res['date']}"),
        ("copy bandwidth TB/s · roofline tok/s", f"{res['copy_TBps']} · {res['roofline_tok_s']}"),
        ("batch-1 decode greedy tok/s (of roofline)", f"{one} ({one / res['roofline_tok_s']:.2f})"),
        ("batch-1 decode UI sampling tok/s (of roofline)",
         f"{res['batch1_ui_sampling_tok_s']} ({res['batch1_ui_sampling_tok_s'] / res['roofline_tok_s']:.2f})"),
    ]
    for n in (2, 4, 8):
        c = res[f"concurrent{n}_greedy"]
        rows.append((f"{n} chats greedy: aggregate tok/s (x one chat)", f"{c['aggregate_tok_s']} "
                     f"({c['aggregate_tok_s'] / one:.2f}x) per chat {min(c['per_chat_tok_s'])}-{max(c['per_chat_tok_s'])}"))
    c = res["concurrent8_ui_sampling"]
    rows.append(("8 chats UI sampling: aggregate tok/s (x one chat)",
                 f"{c['aggregate_tok_s']} ({c['aggregate_tok_s'] / res['batch1_ui_sampling_tok_s']:.2f}x)"))
    rows.append(("batched vs alone greedy prefix match /256", res["batched_vs_alone_greedy_prefix_match_of_256"]))
    rows.append(("TTFT ms by turn 1..5 (worse of 2 chats)", " · ".join(f"{t:.1f}" for t in ttft)))
    rows.append(("turn-5 prompt tokens / prefilled", f"{fifth['prompt_tokens']} / {fifth['prefilled']}"))
    rows.append(("TTFT turn 5 / turn 1", round(ttft[4] / ttft[0], 2)))
    rows.append(("TTFT turn 5 full re-prefill ms", res["ttft_ms_turn5_full_prefill"]))
    print("\n".join(f"{k:50s} {v}" for k, v in rows))


if __name__ == "__main__":
    main()
