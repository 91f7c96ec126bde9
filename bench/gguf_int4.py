"""A GGUF file's int4 (blocks of 32) on the low-bit kernels against our own int4 (groups of 128), one run.

Why: a GGUF file's 4-bit weights keep their blocks of 32 (`quant.int4_group`); before issue 40 part 3
the kernels ran only groups of 128, so those layers dequantized at every call. This measures what
groups of 32 cost on the kernels now, and that they give the reference path's numbers.

Parts, all in one process:
  layers   Qwen2.5-7B's four projection shapes, random weights, in groups of 128 and of 32: each kernel
           (packed and fp32 GEMV at one row, tensor cores at 1, 8 and 64 rows) against the reference
           path's output (the weight dequantized to bf16, `F.linear`) and against the exact fp32 product
  decode   Qwen2.5-7B shapes (28 layers, random weights) through `TorchLLMEngine` as the app runs it
           (CUDA graphs, kernels tuned in this run): int4 in groups of 32 (the model marked as a Q4_K
           GGUF, so `quantize_decoder` picks its groups as for a file) against groups of 128, and groups
           of 128 on the kernels as they were before this change (`--before`: a folder holding them as
           the package `oldplugins`), and int8 (the app's choice for a quantized GGUF file when it fits), batch-1
           tok/s interleaved, eight chats; the reference path's tok/s (eager); per projection the tuned
           kernel's µs at 1 and 8 rows; each group's kernel logits and greedy tokens against its own
           reference path (the same weights dequantized at each call)

    python bench/gguf_int4.py [--layers 28] [--before .oldk]
Writes gguf_int4.json to $OUT; prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_limit import PROJECTIONS, logits_for, rel  # noqa: E402
from llm_engine import GREEDY, QWEN25_7B, UI_DEFAULT, concurrent, random_prompt, random_qwen25_7b, run  # noqa: E402
from timing import report  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.weights.quant import QuantLinear, dequantize, quantize, quantize_decoder, use_kernels  # noqa: E402
from plugins import lowbit  # noqa: E402
from plugins.lowbit_tuning import TunedConfigs, graphed_us  # noqa: E402

OUT_NAME = "gguf_int4"


def layers_part(res: dict) -> None:
    """Each kernel's output on groups of 32 and 128 against the reference path's and the exact product."""
    g = torch.Generator(device="cuda").manual_seed(0)
    table = {}
    for name, (n_in, n_out) in PROJECTIONS.items():
        weight = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        bias = torch.randn(n_out, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1 if name == "qkv" else None
        for group in (128, 32):
            parts = quantize(weight, "int4", torch.bfloat16, group)
            exact = dequantize(parts, "int4")
            workspace = lowbit.Workspace(torch.device("cuda"))
            layer = lowbit.LowBitWeight.from_parts(parts, 4, torch.bfloat16, bias, workspace)
            for rows, kernels in ((1, ("packed", "gemv", "mma")), (8, ("mma",)), (64, ("mma",))):
                x = torch.randn(rows, n_in, device="cuda", dtype=torch.bfloat16, generator=g)
                reference = F.linear(x, exact.to(torch.bfloat16), bias)  # what `QuantLinear` computes without kernels
                product = x.float() @ exact.T + (bias.float() if bias is not None else 0)
                for kernel in kernels:
                    for split in (1, 4) if rows <= 16 else (1,):
                        got = layer(x, lowbit.Config(64, 1, split, kernel=kernel))
                        table[f"{name} g{group} {kernel} rows{rows} split{split}"] = {
                            "vs_reference_path": rel(got, reference),
                            "max_abs_diff": (got - reference).abs().max().item(), "vs_fp32_product": rel(got, product),
                            "reference_path_vs_fp32_product": rel(reference, product)}
            assert not layer.workspace.counters.any()
    res["layers"] = table
    worst = {g: max(v["vs_reference_path"] for k, v in table.items() if f" g{g} " in k) for g in (128, 32)}
    res["layers_worst_rel_err_vs_reference_path"] = worst
    report(OUT_NAME, res)


def before_kernels(model, before) -> None:
    """`use_kernels` with the kernels as they were before groups other than 128 (`oldplugins`)."""
    old_lowbit, old_tuning = before
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    workspace = old_lowbit.Workspace(layers[0].q.device)
    gate_ups = {id(m) for name, m in model.named_modules() if name.endswith("mlp.w_gate_up")}
    for layer in layers:
        layer.kernel = old_lowbit.LowBitWeight.from_parts(layer.parts(), 4 if layer.mode == "int4" else 8, layer.dtype,
                                                          layer.bias, workspace, gated=id(layer) in gate_ups)
        for part in ("q", "scale", "zero"):
            if hasattr(layer, part):
                setattr(layer, part, torch.empty(0, device=layer.kernel.data.device))
    old_tuning.tune_layers([layer.kernel for layer in layers], old_tuning.TunedConfigs())


def kernel_us(model) -> dict:
    """Per projection, the tuned kernel's µs at 1 and 8 rows, rotating through the model's layers (past L2)."""
    out = {}
    for attr in ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down"):
        parent, name = attr.split(".")
        kernels = [getattr(getattr(block, parent), name).kernel for block in model.layers]
        for rows in (1, 8):
            x = torch.randn(rows, kernels[0].in_features, device="cuda", dtype=torch.bfloat16)
            out[f"{name} b{rows}"] = round(graphed_us([lambda i=i: kernels[i % len(kernels)](x) for i in range(24)]), 2)
    return out


def decode_part(res: dict, layers: int, before) -> None:
    vocab = QWEN25_7B["vocab_size"]
    prompt = random_prompt(1, 128)
    float_model = random_qwen25_7b(layers)
    variants = {"g128": ("int4", 128, None), "g32": ("int4", 32, None), "int8_g32_file": ("int8", 32, None)}
    variants |= {"g128_before": ("int4", 128, before)} if before else {}
    models, engines, fidelity, reference_tok_s = {}, {}, {}, {}
    for key, (mode, group, old) in variants.items():
        model = copy.deepcopy(float_model)
        if group == 32:  # as the app makes a Q4_K/Q4_1 GGUF file's int4 (`quant.int4_group`)
            model.config = dataclasses.replace(model.config, gguf_type="Q4_K")
        quantize_decoder(model, mode, "cuda")
        assert all(m.group == group for m in model.modules() if isinstance(m, QuantLinear) and m.mode == "int4")
        if old is None and mode == "int4":  # the reference path: the same weights dequantized at each call
            eager = TorchLLMEngine(model, 4096, vocab, max_batch=1, rows=2, use_cuda_graphs=False)
            with torch.inference_mode():
                ref_tokens, stats = run(eager, prompt, dataclasses.replace(GREEDY, max_new_tokens=64))
                ref_logits = logits_for(eager, prompt + tuple(ref_tokens))
            reference_tok_s[key] = round(stats.tokens_per_s, 1)
            eager.close()
        started = time.perf_counter()
        use_kernels(model, TunedConfigs()) if old is None else before_kernels(model, old)
        res.setdefault("tuning_s", {})[key] = round(time.perf_counter() - started, 1)
        models[key] = model
        engines[key] = TorchLLMEngine(model, 4096, vocab, max_batch=8, rows=16)
        if key in reference_tok_s:
            with torch.inference_mode():
                tokens, _ = run(engines[key], prompt, dataclasses.replace(GREEDY, max_new_tokens=64))
                logits = logits_for(engines[key], prompt + tuple(ref_tokens))
            fidelity[key] = {"greedy_same_as_reference_path_of_64": sum(a == b for a, b in zip(tokens, ref_tokens)),
                             "first_differing_token": next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens))
                                                            if a != b), None),
                             "logit_rel_err_vs_reference_path": rel(logits, ref_logits)}
        print(key, "ready", fidelity.get(key), flush=True)
    del float_model
    torch.cuda.empty_cache()
    res["kernel_vs_reference_path"] = fidelity
    res["reference_path_tok_s_greedy_eager"] = reference_tok_s
    res["weight_bytes_GB"] = {k: round(sum(t.nbytes for m in mdl.modules() if isinstance(m, QuantLinear)
                                           for t in (m.kernel.data, m.kernel.scale, m.kernel.zero) if t is not None)
                                       / 1e9, 3) for k, mdl in models.items()}
    res["kernel_us"] = {k: kernel_us(mdl) for k, mdl in models.items() if k != "int8_g32_file"}
    res["tuned_b1"] = {k: {m.kernel.shape_key(): dataclasses.astuple(m.kernel.config) for m in mdl.modules()
                           if isinstance(m, QuantLinear)} for k, mdl in models.items()}
    report(OUT_NAME, res)
    speeds = {k: {"greedy": [], "ui_sampling": []} for k in engines}
    with torch.inference_mode():
        for engine in engines.values():  # capture this length's graphs
            for params in (GREEDY, UI_DEFAULT):
                run(engine, prompt, params)
        for _ in range(3):  # interleaved: a slower minute of the GPU hits every variant alike
            for key, engine in engines.items():
                for params, name in ((GREEDY, "greedy"), (UI_DEFAULT, "ui_sampling")):
                    speeds[key][name].append(run(engine, prompt, params)[1].tokens_per_s)
        eight = {}
        for key, engine in engines.items():
            concurrent(engine, 8, UI_DEFAULT)  # captures the batch-8 graphs
            eight[key] = concurrent(engine, 8, UI_DEFAULT)["aggregate_tok_s"]
    for engine in engines.values():
        engine.close()
    res["tok_s"] = {k: {p: round(statistics.median(v), 1) for p, v in s.items()} | {"all": s}
                    for k, s in speeds.items()}
    res["8_chats_aggregate_tok_s"] = eight
    base = res["tok_s"]["g128"]
    res["g32_x_g128"] = {p: round(res["tok_s"]["g32"][p] / base[p], 3) for p in ("greedy", "ui_sampling")}
    res["g32_x_g128"]["8_chats"] = round(eight["g32"] / eight["g128"], 3)
    int8 = res["tok_s"]["int8_g32_file"]
    res["g32_x_int8"] = {p: round(res["tok_s"]["g32"][p] / int8[p], 3) for p in ("greedy", "ui_sampling")}
    res["g32_x_int8"]["8_chats"] = round(eight["g32"] / eight["int8_g32_file"], 3)
    res["g32_kernels_x_reference_path"] = round(res["tok_s"]["g32"]["greedy"] / reference_tok_s["g32"], 1)
    if "g128_before" in res["tok_s"]:
        res["g128_x_g128_before"] = {p: round(base[p] / res["tok_s"]["g128_before"][p], 3)
                                     for p in ("greedy", "ui_sampling")}
        res["g128_x_g128_before"]["8_chats"] = round(eight["g128"] / eight["g128_before"], 3)
    report(OUT_NAME, res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--before", help="a folder holding the earlier kernels as the package `oldplugins`")
    ap.add_argument("--parts", default="layers,decode")
    args = ap.parse_args()
    before = None
    if args.before:
        sys.path.insert(0, args.before)
        import oldplugins.lowbit
        import oldplugins.lowbit_tuning
        before = (oldplugins.lowbit, oldplugins.lowbit_tuning)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if "layers" in args.parts:
        layers_part(res)
    if "decode" in args.parts:
        decode_part(res, args.layers, before)
    rows = [("device / date", f"{res['device']} / {res['date']}")]
    if "layers" in res:
        rows.append(("worst kernel rel err vs reference path g128 / g32",
                     " / ".join(f"{v:.5f}" for v in res["layers_worst_rel_err_vs_reference_path"].values())))
    for key in ("tok_s", "g32_x_g128", "g128_x_g128_before", "g32_x_int8", "reference_path_tok_s_greedy_eager",
                "g32_kernels_x_reference_path", "8_chats_aggregate_tok_s", "kernel_us",
                "kernel_vs_reference_path", "weight_bytes_GB"):
        if key in res:
            value = res[key] if key != "tok_s" else {k: {p: v[p] for p in ("greedy", "ui_sampling")}
                                                     for k, v in res[key].items()}
            rows.append((key, value))
    print("\n".join(f"{k:52s} {v}" for k, v in rows))


if __name__ == "__main__":
    main()
