"""GGUF weights on the GPU as the file stores them (issue 49): the kernels of `plugins/gguf_matmul.py` and a
Q4_K_M file at Qwen2.5-7B's shapes against llama.cpp, every ratio from this one run.

Parts (`--parts`, comma-separated):
  kernels  on the GPU, each block type: dequantization inside the kernel against gguf-py bit for bit, every
           row of 2–16 on the tensor-core kernel equal bit for bit to its 16-row call at every position, and of
           a verify step's 2–16 to its one-row call (batch invariance), the products against the dequantized
           weights; then at the four projection shapes of Qwen2.5-7B (and the LM head), µs per call at 1, 2, 8
           and 16 rows and for verify steps, weights rotated past L2, as a fraction of the copy bandwidth
           measured in this run, for one-row launch shapes around the default (the best is kept)
  make     a Qwen2.5-7B-shape Q4_K_M made by llama.cpp's own `llama-quantize` (from a random F16 file written
           with gguf-py), llama.cpp built in `$LLAMA_DIR` by bench/llamacpp.sh (started beside it)
  model    on that file: `llama-bench -p 512 -n 128` and our engine's tg128 (batch 1, CUDA graphs, greedy),
           its GPU memory, our roofline fraction and 8 chats against one
    bash bench/llamacpp.sh build SRC.tar.gz /tmp/llama cuda &  python bench/gguf_native.py --parts make
    python bench/gguf_native.py --parts model       (the next call: /tmp survives back-to-back calls)
Writes gguf_native.json to $OUT after every part; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import copy_bandwidth_tbps, report  # noqa: E402
from plugins.gguf_blocks import FORMATS, row_bytes  # noqa: E402
from plugins.gguf_matmul import Config, GGUFWeight  # noqa: E402
from plugins.lowbit import Workspace, rows_as_one_row  # noqa: E402
from plugins.lowbit_tuning import graphed_us  # noqa: E402

# Qwen2.5-7B's projections in a Q4_K_M file: q/k/v Q4_K (v Q6_K in a third of the layers), o Q4_K,
# gate+up Q4_K, down Q6_K in a third of the layers (else Q4_K), the LM head Q6_K
SHAPES = {"qkv": ("Q4_K", 4608, 3584), "o": ("Q4_K", 3584, 3584), "gate_up": ("Q4_K", 37888, 3584),
          "down": ("Q4_K", 3584, 18944), "lm_head": ("Q6_K", 152064, 3584)}
ROWS = (1, 2, 8, 16)
VERIFY = (2, 5, 9)  # a verify step's rows (1 + 1, 4, 8 drafts), as one-row calls
OUT_NAME = "gguf_native"


def random_raw(kind: str, rows: int, cols: int, device: str = "cuda", seed: int = 0) -> torch.Tensor:
    """A matrix's bytes in `kind`: random quants and sub-scales, fp16 scales of about 0.01 (weights ≲ 1)."""
    fmt = FORMATS[kind]
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols // fmt.size, fmt.nbytes), dtype=torch.uint8, device=device, generator=g)
    for name in ("d", "m"):
        if name in fmt.fields:
            at = fmt.fields[name][0]
            scale = (torch.rand(rows, cols // fmt.size, device=device, generator=g) - 0.5) * 0.02
            raw[..., at:at + 2] = scale.to(torch.float16).view(torch.uint8).view(rows, -1, 2)
    return raw.view(rows, -1)


def check_part(res: dict) -> None:
    """Each block type on the GPU: the in-kernel dequantization against gguf-py (bit for bit), batch
    invariance for 1–16 rows at every position, and the product against the dequantized weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference

    workspace = Workspace(torch.device("cuda"))
    for kind in FORMATS:
        rows, cols = 1024, 4096
        raw = random_raw(kind, rows, cols)
        want = torch.from_numpy(np.array(reference(raw.cpu().numpy(), GGMLQuantizationType[kind]), np.float32))
        weight = GGUFWeight.from_raw(raw, kind, cols, None, workspace)
        weight.config, weight.one_row = Config(block_n=32, split_k=4), Config(block_n=128, split_k=3)  # split-K too
        got = weight.dequantize_rows(torch.arange(rows, device="cuda")).cpu()
        x = torch.randn(16, cols, device="cuda").to(torch.bfloat16)
        full = weight(x)
        invariant = all(torch.equal(weight(x[i:i + m])[j], full[i + j])
                        for m in range(2, 17) for i in (0, 16 - m) for j in range(m))
        one = torch.cat([weight(x[i:i + 1]) for i in range(16)])
        with rows_as_one_row():
            as_one = all(torch.equal(weight(x[i:i + m]), one[i:i + m]) for m in range(2, 17) for i in (0, 16 - m))
        expected = x.float() @ want.cuda().T
        print(kind, "checked", flush=True)
        res[f"{kind} exact / invariant 2–16 / verify rows = one row / product error 16 rows, 1 row"] = (
            bool(torch.equal(got, want)), invariant, as_one,
            round(((full.float() - expected).norm() / expected.norm()).item(), 5),
            round(((one.float() - expected).norm() / expected.norm()).item(), 5))


def speed_part(res: dict) -> None:
    """µs per call at Qwen2.5-7B's shapes and 1–16 rows, weights rotated past L2, against the copy bandwidth."""
    bandwidth = copy_bandwidth_tbps()
    res["copy bandwidth TB/s"] = round(bandwidth, 3)
    workspace = Workspace(torch.device("cuda"))
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    best = {}
    for name, (kind, out_features, in_features) in SHAPES.items():
        one = GGUFWeight.from_raw(random_raw(kind, out_features, in_features), kind, in_features, None, workspace)
        size = out_features * row_bytes(kind, in_features)
        copies = [one] + [GGUFWeight(one.planes, kind, out_features, in_features, None, workspace)
                          for _ in range(max(0, -(-300_000_000 // size) - 1))]
        for c in copies[1:]:  # their own bytes: the same planes would stay in L2
            c.planes = {k: v.clone() for k, v in one.planes.items()}
        ideal_us = size / (bandwidth * 1e12) * 1e6
        candidates = {one.one_row} | {Config(b, s) for b in (128, 256) for s in (1, 2, 3, 4, 6, 8, 12, 16)
                                      if s == 1 or processors // 2 <= -(-out_features // b) * s <= 4 * processors}
        default, timings = one.one_row, {}
        x = torch.randn(1, in_features, device="cuda").to(torch.bfloat16)
        for config in sorted(candidates, key=str):  # one row: the one-row kernel's launch shapes
            for c in copies:
                c.one_row = config
            try:
                timings[config] = graphed_us([lambda c=c: c(x) for c in copies])
            except Exception as e:  # a shape that does not compile (registers): skipped, said
                res[f"{name} {config} failed"] = str(e).splitlines()[0][:120]
        config = min(timings, key=timings.get)
        res[f"{name} fastest one-row shapes (block_n, split, warps: µs)"] = [
            f"{c.block_n},{c.split_k},{c.warps}: {timings[c]:.1f}" for c in sorted(timings, key=timings.get)[:4]]
        best[name] = config
        line = {}
        for rows, verify in [(r, False) for r in ROWS] + [(r, True) for r in VERIFY]:
            for c in copies:
                c.one_row = config
            x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
            with rows_as_one_row(verify):
                us = graphed_us([lambda c=c: c(x) for c in copies])
            line[rows, verify] = us
            res[f"{name} {kind} rows {rows}{' as one row (verify)' if verify else ''}: µs / fraction of bandwidth"] = (
                round(us, 2), round(ideal_us / us, 3))
        report(OUT_NAME, res)  # each shape as it is measured: a cut-short run keeps them
        res[f"{name}: default {default} µs, best {config}, 16 rows ÷ 1, 8 ÷ 1"] = (
            round(timings[default], 2), round(line[16, False] / line[1, False], 2),
            round(line[8, False] / line[1, False], 2))
    res["best one-row configs"] = {k: [v.block_n, v.split_k, v.warps] for k, v in best.items()}


QWEN25_7B_DIMS = {"hidden": 3584, "ffn": 18944, "heads": 28, "kv": 4, "vocab": 152064}
WORK = Path("/tmp/gguf_bench")
Q4_K_M = WORK / "qwen25-7b-shape-Q4_K_M.gguf"


def q4_k_m_kind(part: str, layer: int, layers: int) -> str:
    """The type llama.cpp's Q4_K_M gives a Qwen2.5-7B tensor: Q6_K for the output layer, and for attn_v and
    ffn_down in the first and last eighth of the layers and every third between; Q4_K for the rest."""
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    return "Q6_K" if part == "output" or (part in ("attn_v", "ffn_down") and more) else "Q4_K"


def write_model(path: Path, layers: int, kind_of=lambda part, layer, layers: "F16", c: dict = QWEN25_7B_DIMS,
                device: str = "cuda", vocabulary: Path | None = None) -> None:
    """A Qwen2-architecture model with random weights, written with gguf-py, its vocabulary left out
    (`tokenizer.ggml.model` "none": llama-bench draws random tokens) or copied from the GGUF file `vocabulary`
    (its `tokenizer.*` fields: the app can chat with it): F16 matrices (std 0.02; zero biases, unit norms), or
    where `kind_of(part, layer, layers)` names a block type, random blocks of it."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    writer = GGUFWriter(str(path), "qwen2")
    for key, value in {"context_length": 32768, "embedding_length": c["hidden"], "block_count": layers,
                       "feed_forward_length": c["ffn"], "head_count": c["heads"], "head_count_kv": c["kv"]}.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_vocab_size(c["vocab"])
    if vocabulary is None:
        writer.add_tokenizer_model("none")
    for field in GGUFReader(vocabulary).fields.values() if vocabulary is not None else ():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    writer.add_file_type(1 if kind_of("output", 0, layers) == "F16" else 15)  # mostly F16, or Q4_K_M
    g = torch.Generator(device=device).manual_seed(0)

    def matrix(name: str, rows: int, cols: int, layer: int = 0) -> None:
        kind = kind_of(name.split(".")[-2], layer, layers)
        if kind == "F16":
            w = torch.randn(rows, cols, device=device, generator=g) * 0.02
            writer.add_tensor(name, w.to(torch.float16).cpu().numpy())
        else:
            writer.add_tensor(name, random_raw(kind, rows, cols, device, len(name) + layer).cpu().numpy(),
                              raw_dtype=GGMLQuantizationType[kind])

    def vector(name: str, n: int, value: float = 1.0) -> None:
        writer.add_tensor(name, np.full(n, value, np.float32))

    kv = c["hidden"] // c["heads"] * c["kv"]
    matrix("token_embd.weight", c["vocab"], c["hidden"])
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", c["hidden"])
        for part, rows in (("attn_q", c["hidden"]), ("attn_k", kv), ("attn_v", kv)):
            matrix(p + part + ".weight", rows, c["hidden"], i)
            vector(p + part + ".bias", rows, 0.0)
        matrix(p + "attn_output.weight", c["hidden"], c["hidden"], i)
        vector(p + "ffn_norm.weight", c["hidden"])
        matrix(p + "ffn_gate.weight", c["ffn"], c["hidden"], i)
        matrix(p + "ffn_up.weight", c["ffn"], c["hidden"], i)
        matrix(p + "ffn_down.weight", c["hidden"], c["ffn"], i)
    vector("output_norm.weight", c["hidden"])
    matrix("output.weight", c["vocab"], c["hidden"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def model_folder(path: Path, folder: Path) -> Path:
    """A model folder for a GGUF file without a vocabulary (the app's `gguf_model_dir` also writes tokenizer
    files): its config and a link, which is all `load_gguf_native` reads."""
    from pipeline.llm.weights.gguf_file import hf_config, read_gguf

    model = read_gguf(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config(model) | {"gguf": {"file": str(path), "quant_type": model.quant_type,
                                          "tensor_types": list(model.matrix_types)}}
    (folder / "config.json").write_text(json.dumps(config))
    if not (folder / path.name).exists():
        (folder / path.name).symlink_to(path)
    return folder


def make_part(res: dict, layers: int) -> None:
    """The Q4_K_M file: an F16 one written while llama.cpp builds (bench/llamacpp.sh, started beside this),
    then llama.cpp's own quantizer, as a user makes a Q4_K_M."""
    WORK.mkdir(exist_ok=True)
    f16 = WORK / "qwen25-7b-shape-f16.gguf"
    started = time.perf_counter()
    write_model(f16, layers)
    res["F16 file written s"] = round(time.perf_counter() - started, 1)
    quantize = LLAMA / "build/bin/llama-quantize"
    deadline = time.perf_counter() + 420
    while not quantize.exists():  # the build beside this run
        if time.perf_counter() > deadline:
            raise SystemExit(f"llama.cpp did not build in time: see {LLAMA}/build.log")
        time.sleep(5)
    started = time.perf_counter()
    subprocess.run([str(quantize), str(f16), str(Q4_K_M), "Q4_K_M", str(os.cpu_count())], check=True,
                   stdout=subprocess.DEVNULL)
    res["llama-quantize Q4_K_M s"] = round(time.perf_counter() - started, 1)
    res["Q4_K_M file GB"] = round(Q4_K_M.stat().st_size / 1e9, 3)
    f16.unlink()


def model_part(res: dict, layers: int) -> None:
    """llama-bench (tg128, pp512, all layers on the GPU) and our engine (tg128 greedy, batch 1, CUDA graphs;
    8 chats at once) on the Q4_K_M file, its GPU memory, and our tg128 against its roofline (the bytes a
    token reads at the copy bandwidth of this run)."""
    from llm_engine import concurrent, random_prompt, run
    from pipeline.llm.engine.params import SamplingParams
    from pipeline.llm.engine.torch_engine import TorchLLMEngine
    from pipeline.llm.model.loading import load_gguf_native
    from pipeline.llm.weights.gguf_native import GGUFLinear

    path = Q4_K_M
    if (LLAMA / "build/bin/llama-bench").exists():
        done = subprocess.run([str(LLAMA / "build/bin/llama-bench"), "-m", str(Q4_K_M), "-p", "512", "-n", "128",
                               "-ngl", "99", "-r", "5", "-o", "json"], capture_output=True, text=True, check=True)
        for row in json.loads(done.stdout):
            test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
            res[f"llama.cpp {test} tok/s"] = round(row["avg_ts"], 1)
    else:  # no llama.cpp here: a file of random blocks in Q4_K_M's types, ours alone
        WORK.mkdir(exist_ok=True)
        path = WORK / "random-blocks-Q4_K_M.gguf"
        write_model(path, layers, q4_k_m_kind)
        res["file"] = "random blocks in llama.cpp's Q4_K_M types (no llama.cpp in this run)"
    bandwidth = res.get("copy bandwidth TB/s") or copy_bandwidth_tbps()
    res["copy bandwidth TB/s"] = round(bandwidth, 3)
    before = torch.cuda.memory_allocated()
    started = time.perf_counter()
    model = load_gguf_native(model_folder(path, WORK / path.stem), torch.bfloat16, torch.device("cuda"))
    res["ours: load s"] = round(time.perf_counter() - started, 1)
    weights = torch.cuda.memory_allocated() - before
    res["gpu_memory_x_file"] = round(weights / path.stat().st_size, 3)
    per_token = sum(m.nbytes for m in model.modules() if isinstance(m, GGUFLinear)) + \
        sum(p.nbytes for p in model.parameters())
    roofline = bandwidth * 1e12 / per_token
    engine = TorchLLMEngine(model, 4096, QWEN25_7B_DIMS["vocab"], max_batch=8, rows=16)
    tg128 = SamplingParams(max_new_tokens=128, temperature=0, repetition_penalty=1.0)
    prompt = random_prompt(1, 512)
    with torch.inference_mode():
        started = time.perf_counter()
        run(engine, prompt, tg128)  # compiles the kernels, captures the graphs
        res["ours: first reply s (kernels compiled, graphs captured)"] = round(time.perf_counter() - started, 1)
        ours = sorted(run(engine, prompt, tg128)[1].tokens_per_s for _ in range(5))[2]
        concurrent(engine, 8, tg128)  # captures the batch's graphs
        eight = concurrent(engine, 8, tg128)["aggregate_tok_s"]
    res["ours tg128 tok/s"] = round(ours, 1)
    if "llama.cpp tg128 tok/s" in res:
        res["tg128_x_llamacpp"] = round(ours / res["llama.cpp tg128 tok/s"], 3)
    res["roofline tok/s (bytes per token / copy bandwidth)"] = round(roofline, 1)
    res["roofline_fraction"] = round(ours / roofline, 3)
    res["ours 8 chats ÷ 1 chat"] = round(eight / ours, 2)


LLAMA = Path(os.environ.get("LLAMA_DIR", "/tmp/llama"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="kernels")
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    res = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d")}
    for part in args.parts.split(","):
        {"kernels": lambda: (check_part(res), speed_part(res)), "make": lambda: make_part(res, args.layers),
         "model": lambda: model_part(res, args.layers)}[part]()
        report(OUT_NAME, res)


if __name__ == "__main__":
    main()
