"""Batch-invariant mode (`--batch-invariant`) on the CPU: the invariant GEMM kernel under Triton's interpreter
(its sums against torch's, a row's bits alone and among others, split-K with a bias), where the mode is
refused and the start-up report saying so, and the flag. On a GPU: `tests/test_gpu.py` (a chat's logits
alone = beside others, bit for bit) and `bench/invariant_kernels.py` (every launch shape, the attention)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.llm.model.decoder import Decoder
from pipeline.llm.model.invariant import make_batch_invariant
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.weights.quant import quantize_decoder
from plugins import invariant_matmul
from studio.backends import load_language_model
from studio.config import parse_config
from engine_builder.cache import EngineCache
from engine_builder.build import EngineOptions

ROOT = Path(__file__).resolve().parents[1]
CONFIG = DecoderConfig(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=128, qkv_bias=True)

SCRIPT = r'''
import torch
from plugins.invariant_matmul import Shape, invariant_linear, shape_for, splits
torch.manual_seed(0)
for n, k in ((64, 4096), (200, 300)):  # split-K in four (inputs cut at 1,024), and unsplit with a ragged tail
    w, b = torch.randn(n, k) / k ** 0.5, torch.randn(n)
    x = torch.randn(2, 8, k)
    full = invariant_linear(x, w, b)
    assert full.shape == (2, 8, n)
    assert torch.allclose(full, x @ w.T + b, atol=1e-5, rtol=1e-5), (full - (x @ w.T + b)).abs().max()
    rows = x.reshape(16, k)
    for m in (1, 3, 16):  # a row's bits alone and among 3 or 16 (the interpreter: one launch shape, see the test)
        assert torch.equal(invariant_linear(rows[:m], w, b), full.reshape(16, n)[:m]), (n, k, m)
        # one program summing the splits itself (a prompt's rows) = the splits' programs and their sum's
        walked = Shape(**{**shape_for(m, n).__dict__, "walk": True})
        assert torch.equal(invariant_linear(rows[:m], w, b, shape=walked), full.reshape(16, n)[:m]), (n, k, m)
    assert torch.allclose(invariant_linear(rows[:5], w), rows[:5] @ w.T, atol=1e-5, rtol=1e-5)  # no bias
    assert invariant_linear(rows[:0], w, b).shape == (0, n)
assert splits(64, 4096, torch.device("cpu")) == 4 and splits(200, 300, torch.device("cpu")) == 1
print("ok")
'''


@pytest.mark.skipif(invariant_matmul.triton is None, reason="Triton is not installed")
def test_the_invariant_gemm_sums_as_torch_does_and_gives_a_row_the_same_bits_alone_and_among_others():
    """Under the interpreter every launch shape's dot is numpy's, whose sums follow the tile's size (so rows
    up to 16, one shape, are compared here); on the GPU the tensor cores add 16 inputs at a time in order for
    every shape, checked bit for bit by `bench/invariant_kernels.py`."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_batch_invariant_mode_is_refused_on_the_cpu_and_for_low_bit_weights_leaving_the_model_as_it_was():
    torch.manual_seed(0)
    model = Decoder(CONFIG).eval()
    assert "CUDA GPU" in make_batch_invariant(model)
    quantized = quantize_decoder(Decoder(CONFIG).to(torch.bfloat16), "int4", "cpu")
    assert "low-bit" in make_batch_invariant(quantized)
    assert "ONNX Runtime" in make_batch_invariant(nn.Module())  # not a torch decoder: the CPU's GGUF on ONNX Runtime
    for m in (model, quantized):
        assert all(module.kernels.decode_attention.__name__ == "decode_attention_fused"
                   for module in m.modules() if hasattr(module, "kernels"))
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 4 * CONFIG.num_layers + 1


def test_the_flag_reaches_the_chat_model_and_the_start_up_report_says_why_it_is_off(qwen2_demo, tmp_path):
    """On by default where it can be (float weights on a GPU), silently off elsewhere; asked for where it cannot
    be, the start-up report says why; --no-batch-invariant keeps cuBLAS's kernels."""
    class Report:
        lines: list[str] = []

        def tell(self, line: str) -> None:
            self.lines.append(line)

        say = tell

    assert parse_config(["--batch-invariant"]).batch_invariant is True
    assert parse_config(["--no-batch-invariant"]).batch_invariant is False
    assert parse_config([]).batch_invariant is None
    for asked in (True, None):
        Report.lines = []
        llm = load_language_model(qwen2_demo, "demo/qwen2-tiny", max_context=256, max_batch=2, batch_invariant=asked,
                                  engines=EngineOptions(EngineCache(tmp_path), Report()))
        try:
            said = any("--batch-invariant is off: batch-invariant GEMMs need a CUDA GPU" in line for line in Report.lines)
            assert said == bool(asked), Report.lines
            assert "batch-invariant" not in llm.description
        finally:
            llm.close()
