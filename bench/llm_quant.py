"""Weight-only int8/int4 against bf16 decode, in one run (issue 10, must-show 1).

Qwen2.5-7B shapes, random bf16 weights (speed does not depend on values), each mode through
`TorchLLMEngine` as the app runs it (CUDA graphs; gemlite kernels for int8/int4). Per mode:
batch-1 decode tok/s greedy and with the UI's default sampling, the memory roofline of that mode's
bytes per token (measured copy bandwidth), greedy agreement with bf16 over 64 tokens, the last-token
logit error against bf16 on the same 192 tokens, and where a decode step's time goes (profiler,
kernels grouped). Then a small real-format checkpoint (transformers' Qwen2 at Qwen2.5-0.5B widths,
saved by `save_pretrained`) loaded through our loader in each mode, its logits against transformers'.

    python bench/llm_quant.py [--layers 28]      # on the GPU
    python bench/llm_quant.py --smoke            # tiny shapes on the CPU: checks the script, times nothing
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llm_engine import QWEN25_7B, UI_DEFAULT, random_prompt, run  # noqa: E402
from timing import copy_bandwidth_tbps, report  # noqa: E402
from pipeline.llm.checkpoint import load_decoder  # noqa: E402
from pipeline.llm.config import config_from_hf  # noqa: E402
from pipeline.llm.engine import Prompt, TorchLLMEngine  # noqa: E402
from pipeline.llm.model import Decoder  # noqa: E402
from pipeline.llm.quant import MODES, QuantLinear, quantize_decoder, use_kernels  # noqa: E402
from pipeline.llm.sampling import SamplingParams  # noqa: E402

SMOKE = {**QWEN25_7B, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2}
KERNEL_GROUPS = (  # profiler kernel name fragments → where the time went
    ("GEMV/GEMM (weights)", ("gemv", "gemm", "gemlite", "cutlass", "xmma", "cublas", "splitk", "matmul", "nvjet")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax_warp")),
    ("norm (+ residual add)", ("rms_norm",)),
    ("rotary", ("rotary",)),
    ("SiLU·up", ("silu",)),
    ("sampling", ("topk", "sort", "cumsum", "searchsorted", "argmax", "softmax", "scatter", "bitonic", "radix")),
    ("KV write / copies / indexing", ("copy", "index", "cat", "fill", "elementwise")),
)


def random_model(config_dict: dict, layers: int, device: str, dtype: torch.dtype) -> Decoder:
    with torch.device("meta"):
        model = Decoder(config_from_hf({**config_dict, "num_hidden_layers": layers}))
    model = model.to_empty(device=device).to(dtype).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.02)
    return model


def bytes_per_token(model: Decoder) -> int:
    """What one decode step reads: every weight but the embedding table (one row of it)."""
    total = sum(b.nbytes for m in model.modules() if isinstance(m, QuantLinear) for b in m.parts().values())
    plain = sum(p.nbytes for n, p in model.named_parameters() if n != "embed.weight")
    return total + plain


def profile_step(engine, prompt, tokens: int = 32) -> dict[str, float]:
    """Microseconds per decode step by kernel group (the prefill's kernels are counted too, once)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(engine, prompt, SamplingParams(max_new_tokens=tokens, temperature=0.7, top_p=0.8, top_k=20,
                                           repetition_penalty=1.05, seed=0))
    groups: dict[str, float] = collections.defaultdict(float)
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0))
        name = event.key.lower()
        group = next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "other")
        groups[group] += us / tokens
    return {g: round(v, 1) for g, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v >= 0.5}


def logits_for(engine, ids: tuple[int, ...]) -> torch.Tensor:
    stream = engine.submit(Prompt(ids), SamplingParams(max_new_tokens=1, temperature=0), set(), keep_logits=True)
    stream.wait()
    return stream.logits[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(((a.float() - b.float()).norm() / b.float().norm()).item(), 5)


def kernel_errors() -> dict[str, float]:
    """gemlite's batch-1 GEMV against the dequantizing reference, with its split-K partial sums added
    in bfloat16 (gemlite's default on Hopper) and in float32 (what `use_kernels` sets)."""
    import gemlite

    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for n_in, n_out in ((3584, 4608), (18944, 3584)):
        linear = torch.nn.Linear(n_in, n_out, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, n_in, device="cuda", dtype=torch.bfloat16, generator=g)
        for mode in ("int8", "int4"):
            for atomics in ("bf16", "fp32"):
                layer = QuantLinear.from_linear(linear, mode)
                expected = torch.nn.functional.linear(x, layer.weight_float().to(torch.bfloat16), linear.bias).float()
                layer.use_kernel()
                gemlite.set_native_atomic_bfp16(atomics == "bf16")
                out[f"{mode} {n_in}->{n_out} {atomics} adds"] = rel_err(layer(x), expected)
    gemlite.set_native_atomic_bfp16(False)
    return out


def real_format_vs_transformers(device: str, smoke: bool) -> dict:
    """A transformers Qwen2 checkpoint (Qwen2.5-0.5B widths, 4 layers, random weights) through our
    loader in each mode: last-token logit error against transformers on the same prompt."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=4096 if smoke else 151936, hidden_size=896, intermediate_size=4864,
                                      num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2,
                                      max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    dtype = torch.float32 if smoke else torch.bfloat16
    with torch.device(device):  # initialising 0.5 B parameters on the host takes minutes
        ref = transformers.Qwen2ForCausalLM(config).to(dtype).eval()
    ids = random_prompt(3, 64)
    ids = tuple(i % config.vocab_size for i in ids)
    with torch.inference_mode():
        expected = ref(torch.tensor([ids], device=device)).logits[0, -1].float()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        del ref
        for mode in MODES:
            model = load_decoder(Path(tmp), dtype=dtype, device="cpu")
            if mode != "none":
                quantize_decoder(model, mode, device)
            model = model.to(device)
            if mode != "none" and device == "cuda":
                use_kernels(model)
            engine = TorchLLMEngine(model, 512, config.vocab_size, max_batch=1, rows=1)
            with torch.inference_mode():
                out[mode] = rel_err(logits_for(engine, ids), expected.cpu())
            engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shapes, layers = (SMOKE, 2) if args.smoke else (QWEN25_7B, args.layers)
    res: dict = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d"), "shapes": "smoke" if args.smoke else f"Qwen2.5-7B, {layers} layers"}
    if not args.smoke:
        import gemlite

        res["gemlite"] = gemlite.__version__
        res["copy_TBps"] = round(copy_bandwidth_tbps(), 3)
    started = time.perf_counter()
    prompt = random_prompt(1, 128)
    prompt = tuple(i % shapes["vocab_size"] for i in prompt)
    greedy = SamplingParams(max_new_tokens=args.tokens, temperature=0, repetition_penalty=1.0)
    reference_tokens: list[int] = []
    reference_logits = None
    for mode in MODES:
        model = random_model(shapes, layers, device, torch.float32 if args.smoke else torch.bfloat16)
        if mode != "none":
            quantize_decoder(model, mode, device)
        row: dict = {"bytes_per_token_GB": round(bytes_per_token(model) / 1e9, 3)}
        if not args.smoke:
            row["roofline_tok_s"] = round(res["copy_TBps"] * 1e12 / bytes_per_token(model), 1)
            if mode != "none":
                use_kernels(model)
        engine = TorchLLMEngine(model, 4096, shapes["vocab_size"], max_batch=1, rows=2)
        with torch.inference_mode():
            for params, key in ((greedy, "greedy"), (UI_DEFAULT, "ui_sampling")):
                run(engine, prompt, params)  # captures this length's graphs
                row[f"{key}_tok_s"] = round(statistics.median(run(engine, prompt, params)[1].tokens_per_s
                                                              for _ in range(1 if args.smoke else 3)), 1)
            tokens, _ = run(engine, prompt, SamplingParams(max_new_tokens=64, temperature=0, repetition_penalty=1.0))
            if mode == "none":
                reference_tokens = tokens
            row["greedy_agrees_with_bf16_for_tokens_of_64"] = next(
                (i for i, (a, b) in enumerate(zip(tokens, reference_tokens)) if a != b), 64)
            row["greedy_same_tokens_of_64"] = sum(a == b for a, b in zip(tokens, reference_tokens))
            logits = logits_for(engine, prompt + tuple(reference_tokens))  # teacher-forced: the same 192 tokens
            if mode == "none":
                reference_logits = logits
            row["last_token_logit_rel_err_vs_bf16"] = rel_err(logits, reference_logits)
            if not args.smoke:
                row["us_per_token_by_kernel_group"] = profile_step(engine, prompt)
        engine.close()
        res[mode] = row
        print(f"[{time.perf_counter() - started:.0f} s] {mode}: {row}", flush=True)
        report("llm_quant", res)  # written after each mode: a run cut short keeps what it measured
        del model, engine
        if not args.smoke:
            torch.cuda.empty_cache()
    if not args.smoke:
        res["gemv_rel_err_vs_reference"] = kernel_errors()
    res["real_format_last_token_logit_rel_err_vs_transformers"] = real_format_vs_transformers(device, args.smoke)
    report("llm_quant", res)

    bf16 = res["none"]
    lines = [("device / date", f"{res['device']} / {res['date']}")]
    for mode in MODES:
        r = res[mode]
        roof = f" · roofline {r['roofline_tok_s']} ({r['ui_sampling_tok_s'] / r['roofline_tok_s']:.2f} with UI sampling)" \
            if "roofline_tok_s" in r else ""
        lines.append((f"{mode}: greedy / UI sampling tok/s", f"{r['greedy_tok_s']} / {r['ui_sampling_tok_s']}{roof}"))
        lines.append((f"{mode}: x bf16 (greedy, UI sampling)", f"{r['greedy_tok_s'] / bf16['greedy_tok_s']:.2f}x, "
                      f"{r['ui_sampling_tok_s'] / bf16['ui_sampling_tok_s']:.2f}x"))
        lines.append((f"{mode}: greedy = bf16 for / same of 64 · logit err",
                      f"{r['greedy_agrees_with_bf16_for_tokens_of_64']} / {r['greedy_same_tokens_of_64']} · "
                      f"{r['last_token_logit_rel_err_vs_bf16']}"))
    lines.append(("real-format logits vs transformers", res["real_format_last_token_logit_rel_err_vs_transformers"]))
    print("\n".join(f"{k:44s} {v}" for k, v in lines))


if __name__ == "__main__":
    main()
