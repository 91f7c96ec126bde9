"""The low-bit kernel of `plugins/lowbit.py` runs on the CPU through Triton's interpreter
(TRITON_INTERPRET=1) against the dequantizing reference of `pipeline/llm/quant.py`: int4 and int8,
bf16 and fp16 activations, with and without bias, split-K (whose counters must be left at zero for the
next call), batches 1 (the tensor-core kernel and the CUDA-core GEMV), 2–4, 5–16 and prefill, and widths that leave a partial output tile. On a GPU,
`tests/test_gpu.py` checks it compiled at Qwen2.5-7B's shapes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import itertools
import torch
from plugins import lowbit
from pipeline.llm.quant import dequantize, quantize
torch.manual_seed(0)

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

cases = [  # rows, out, in, (rows per program, chunks per step, split-K)
    (1, 96, 256, (32, 1, 1)), (1, 80, 512, (32, 2, 4)), (1, 64, 384, (16, 2, 3)), (3, 64, 512, (16, 2, 2)), (4, 64, 384, (16, 2, 3)),
    (7, 48, 256, (32, 1, 2)), (20, 48, 256, (32, 1, 1)),
]
for mode, bits in (("int4", 4), ("int8", 8)):
    for dtype in (torch.bfloat16, torch.float16):
        for rows, n, k, shape in cases:
            w = torch.randn(n, k) * 0.05
            parts = quantize(w, mode, dtype)
            bias = torch.randn(n).to(dtype) if rows % 2 else None
            x = torch.randn(rows, k).to(dtype)
            expected = x.float() @ dequantize(parts, mode).to(dtype).float().T
            if bias is not None:
                expected += bias.float()
            layer = lowbit.LowBitWeight.from_parts(parts, bits, dtype, bias, lowbit.Workspace(torch.device("cpu")))
            kernels = ("mma", "gemv") if rows == 1 else ("mma",)
            for kernel, call in itertools.product(kernels, range(2)):  # call 2: the split-K counters were reset
                got = layer(x, lowbit.Config(*shape, kernel=kernel))
                tol = 6e-3 if dtype == torch.bfloat16 else 5e-4  # the output's rounding
                assert got.shape == (rows, n) and rel(got, expected) < tol, (mode, kernel, dtype, rows, shape, call, rel(got, expected))
            assert not layer.workspace.counters.any()
print("ok")
'''


def test_lowbit_kernels_match_the_dequantizing_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


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
