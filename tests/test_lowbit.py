"""The low-bit kernel of `plugins/lowbit.py` runs on the CPU through Triton's interpreter
(TRITON_INTERPRET=1) against the dequantizing reference of `pipeline/llm/weights/quant.py`: int4 and int8,
bf16 and fp16 activations, with and without bias, split-K (whose counters must be left at zero for the
next call), batches 1 (the tensor-core kernel and the CUDA-core GEMV), 2–4, 5–16 and prefill, plain
and gated (SiLU(gate)·up made in the kernel's last step), and widths that leave a partial output tile;
int4 in our groups of 128 and in a GGUF file's groups of 32 (and 64). The packed-pair GEMV's PTX
(`fma.rn.bf16x2`, `prmt`) runs here as its fp32 emulation with the hardware's rounding.
On a GPU, `tests/test_gpu.py` checks it compiled at Qwen2.5-7B's shapes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed")
ROOT = Path(__file__).resolve().parents[1]

CASES = [  # rows, out, in, (rows per program, chunks per step, split-K)
    (1, 96, 256, (64, 1, 1)), (1, 80, 512, (32, 2, 4)), (1, 64, 384, (16, 2, 3)), (3, 64, 512, (16, 2, 2)),
    (4, 64, 384, (16, 2, 3)), (7, 48, 256, (32, 1, 2)), (20, 48, 256, (32, 1, 1)),
]
GROUP_CASES = [(1, 96, 256, (64, 1, 1)), (1, 80, 512, (32, 2, 4)), (1, 64, 384, (16, 2, 3)), (3, 64, 512, (16, 2, 2)),
               (20, 48, 256, (32, 1, 1)),
               (1, 96, 576, (64, 1, 2)), (3, 64, 576, (16, 2, 2)), (20, 48, 576, (32, 1, 1))]  # 4.5 chunks: padded

SCRIPT = r'''
import itertools
import torch
from plugins import lowbit
from pipeline.llm.weights.quant import dequantize, quantize
torch.manual_seed(0)

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

for (mode, bits, group, cases) in RUNS:
    for dtype in (torch.bfloat16, torch.float16):
        for (rows, n, k, shape), gated in itertools.product(cases, (False, True)):
            if gated and (dtype == torch.float16 or not (rows > 16 or shape[2] == 4)):
                continue  # the gated epilogue is dtype-blind: bf16, one row split four ways (its partials and a
                # partial tile, through each kernel) and prefill cover it
            w = torch.randn(n, k) * 0.05
            parts = quantize(w, mode, dtype, group)
            assert mode == "int8" or parts["scale"].shape == (n, k // group)
            bias = torch.randn(n).to(dtype) if rows % 2 else None
            x = torch.randn(rows, k).to(dtype)
            expected = x.float() @ dequantize(parts, mode).to(dtype).float().T
            if bias is not None:
                expected += bias.float()
            if gated:  # the gate projection's rows above the up projection's
                expected = torch.nn.functional.silu(expected[:, :n // 2]) * expected[:, n // 2:]
            layer = lowbit.LowBitWeight.from_parts(parts, bits, dtype, bias, lowbit.Workspace(torch.device("cpu")),
                                                   gated)
            kernels = [k for k in ("mma", "gemv", "packed") if lowbit.kernel_for(lowbit.Config(kernel=k), bits, dtype,
                                                                                   rows) == k]  # each one once
            calls = 2 if shape[2] > 1 and rows <= 16 else 1  # call 2: the split-K counters were reset (unsplit,
            for kernel, call in itertools.product(kernels, range(calls)):  # and prefill: none)
                got = layer(x, lowbit.Config(*shape, kernel=kernel))
                tol = 6e-3 if dtype == torch.bfloat16 else 5e-4  # the output's rounding (gated, 2+ rows: twice)
                tol *= 2 if gated and rows > 1 else 1
                if lowbit.kernel_for(lowbit.Config(kernel=kernel), bits, dtype, rows) == "packed":
                    tol = 2e-2 if gated else 1e-2  # products rounded to bf16 in fours (measured: 0.4 %, gated 0.7 %)
                assert got.shape == expected.shape and rel(got, expected) < tol, \
                    (mode, group, kernel, gated, dtype, rows, shape, call, rel(got, expected))
            assert not layer.workspace.counters.any()
print("ok")
'''


ROWS_SCRIPT = r'''
import itertools
import torch
from plugins import lowbit
from pipeline.llm.weights.quant import quantize
torch.manual_seed(0)
for (mode, bits, group), dtype, kernel, (n, k, shape, gated) in itertools.product(
        (("int4", 4, 128), ("int4", 4, 32), ("int8", 8, 128)), (torch.bfloat16, torch.float16),
        ("packed", "gemv", "mma"), ((80, 512, (64, 2, 4), True), (64, 576, (64, 1, 2), False))):
    if lowbit.kernel_for(lowbit.Config(kernel=kernel), bits, dtype, 1) != kernel:
        continue  # "packed" is "gemv" here: checked once
    parts = quantize(torch.randn(n, k) * 0.05, mode, dtype, group)
    bias = torch.randn(n).to(dtype) if gated else None
    layer = lowbit.LowBitWeight.from_parts(parts, bits, dtype, bias, lowbit.Workspace(torch.device("cpu")), gated)
    layer.config = lowbit.Config(*shape, kernel=kernel)
    x = torch.randn(1, 3, k).to(dtype)
    alone = torch.cat([layer(x[:, i:i + 1]) for i in range(3)], 1)
    with lowbit.rows_as_one_row():
        together = layer(x)
    assert torch.equal(together, alone), (mode, group, dtype, kernel, gated, (together - alone).abs().max())
    assert not layer.workspace.counters.any()
print("ok")
'''

MLP_SCRIPT = r'''
import torch
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.weights.quant import quantize_decoder, use_kernels
torch.manual_seed(0)
config = DecoderConfig(family="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=64, max_position_embeddings=256, qkv_bias=True)
model = quantize_decoder(Decoder(config).to(torch.bfloat16), "int4", "cpu")
mlp = model.layers[0].mlp
xs = [torch.randn(rows, 128).to(torch.bfloat16) for rows in (1, 3)]  # SiLU·mul in the kernel; after it
references = [mlp(x).float() for x in xs]
assert use_kernels(model) == 5 and mlp.w_gate_up.applies_silu_mul and not mlp.w_down.applies_silu_mul
for x, reference in zip(xs, references):
    got = mlp(x).float()
    err = ((got - reference).norm() / reference.norm()).item()
    assert got.shape == reference.shape and err < 2e-2, (len(x), err)
print("ok")
'''


def run_interpreted(script: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_lowbit_kernels_match_the_dequantizing_reference_under_the_interpreter():
    run_interpreted(f"RUNS = [('int4', 4, 128, {CASES}), ('int8', 8, 128, {CASES})]\n" + SCRIPT)


def test_int4_in_a_gguf_files_groups_of_32_matches_the_reference_under_the_interpreter():
    """A GGUF file's int4 keeps its blocks of 32 (`quant.int4_group`): four scales and zero points per
    64-byte chunk, each applied to its own inputs, in the packed and fp32 GEMVs and the tensor-core kernel
    (one and several rows, prefill, bias, gated, split-K), within the tolerances of groups of 128; and
    groups of 64. A kernel that read a neighbouring group's scale would be far off."""
    # wider layers: a gated layer of 32 outputs came near the bf16 tolerance by chance; tiles of 64 rows (the last
    # one partial) split 4 ways and of 32 split 3 ways, through each one-row kernel (the tensor-core kernel's rows
    # are the same code at 1 row as at 2–16: several rows in `GROUP_CASES`)
    wider = [(1, 160, 512, (64, 2, 4)), (1, 128, 384, (32, 2, 3))]
    runs = [("int4", 4, 32, GROUP_CASES), ("int4", 4, 64, wider)]
    run_interpreted(f"RUNS = {runs}\n" + SCRIPT)


def test_rows_as_one_row_give_each_row_the_one_row_calls_numbers_bit_for_bit():
    """Within `rows_as_one_row` (speculative decoding's verify step of one chat), three rows through a
    layer equal three one-row calls exactly, for each one-row kernel (the packed-pair GEMV, the fp32
    GEMV, the tensor cores), int4 (groups of 128 and 32) and int8, bf16 and fp16, gated with a bias and split
    four ways: the verify step's greedy tokens are then those of the decode steps it stands for."""
    run_interpreted(ROWS_SCRIPT)

def test_a_quantized_mlp_applies_silu_mul_in_the_gate_up_kernel_once():
    """`use_kernels` gives each MLP's gate and up projection the gated kernel, and the MLP then skips its
    own SiLU·mul: the output is the reference MLP's (applied twice, or not at all, it is far off)."""
    run_interpreted(MLP_SCRIPT)


def test_configs_shipped_for_a_gpu_model_fill_only_the_shapes_not_tuned_on_this_machine(tmp_path, monkeypatch):
    """A first launch on a GPU model we tuned on takes the release's configs (`plugins/tuned`) and times
    nothing for those shapes; this machine's own configs win; another GPU model takes none."""
    import dataclasses
    import json
    from plugins import lowbit_tuning
    from plugins.lowbit import Config
    from plugins.lowbit_tuning import TunedConfigs

    monkeypatch.setattr(lowbit_tuning, "SHIPPED", tmp_path)
    shipped = {"int4 a b1": Config(64, 2, 8), "int4 b b1": Config(128, 1, 2)}
    (tmp_path / TunedConfigs.shipped_name("NVIDIA H200")).write_text(
        json.dumps({k: dataclasses.asdict(v) for k, v in shipped.items()}))
    said: list[str] = []
    tuned = TunedConfigs(said.append)
    tuned.from_json(json.dumps({"int4 a b1": dataclasses.asdict(Config(256, 1, 1))}))  # tuned here before
    tuned.adopt_shipped("NVIDIA H200")
    assert tuned.configs == {"int4 a b1": Config(256, 1, 1), "int4 b b1": Config(128, 1, 2)} and not tuned.changed
    assert said == ["low-bit kernel configs tuned for the NVIDIA H200 in this release: 1 taken, not timed again"]
    other = TunedConfigs()
    other.adopt_shipped("NVIDIA H100 80GB HBM3")
    assert other.configs == {}


def test_the_shipped_configs_read_as_configs_of_both_batch_buckets():
    from plugins.lowbit_tuning import CANDIDATES, KERNEL_VERSION, SHIPPED, TunedConfigs

    files = sorted(SHIPPED.glob("lowbit-*.json"))
    assert files and all(f.name.endswith(f"-v{KERNEL_VERSION}.json") for f in files)
    for f in files:
        tuned = TunedConfigs()
        tuned.from_json(f.read_text())
        shapes = {k.rsplit(" b", 1)[0] for k in tuned.configs}
        assert shapes and set(tuned.configs) == {f"{s} b{rows}" for s in shapes for rows in CANDIDATES}, f.name


def test_tuned_configs_round_trip_and_a_damaged_file_is_tuned_again():
    """What the app stores beside the engine cache comes back the same; a damaged file is not trusted:
    it is said, and every shape is tuned again (no configs kept)."""
    from plugins.lowbit import Config
    from plugins.lowbit_tuning import TunedConfigs

    tuned = TunedConfigs()
    tuned.configs = {"int4 3584->4608 +bias b1": Config(64, 2, 8), "int4 3584->4608 +bias b8": Config(128, 1, 2, 8, 4)}
    again = TunedConfigs()
    again.from_json(tuned.to_json())
    assert again.configs == tuned.configs and not again.changed
    said: list[str] = []
    damaged = TunedConfigs(said.append)
    damaged.from_json(tuned.to_json()[:40])
    assert damaged.configs == {} and "unreadable" in said[0]
    wrong_fields = TunedConfigs(said.append)
    wrong_fields.from_json('{"int4 x b1": {"block_n": 64, "kind": "fma"}}')
    assert wrong_fields.configs == {} and len(said) == 2
