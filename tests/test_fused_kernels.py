"""The Triton kernels of `plugins/fused.py` run on the CPU through Triton's interpreter
(TRITON_INTERPRET=1), against the torch reference. On a GPU, `tests/test_gpu.py` checks them compiled.
The interpreter truncates where CUDA rounds to bf16, so bf16 results differ by ~0.5 %; float32 is exact."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed (requirements-dev.txt installs it on Linux x86-64)")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import torch
from plugins import fused
fused._use_triton = lambda x: True  # the interpreter runs the kernels on CPU tensors
torch.manual_seed(0)

def worst(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1.5e-2)):  # bf16: the interpreter truncates
    x, d = torch.randn(3, 5, 96).to(dtype), torch.randn(3, 5, 96).to(dtype)
    w = torch.rand(96).to(dtype)
    (total, normed), (total_ref, normed_ref) = fused.add_rms_norm_fused(x, d, w, 1e-6), \
        fused.add_rms_norm_reference(x, d, w, 1e-6)
    assert worst(total, total_ref) <= tol and worst(normed, normed_ref) <= tol, dtype
    assert worst(fused.rms_norm_fused(x, w, 1e-6), fused.rms_norm_reference(x, w, 1e-6)) <= tol
    gu = torch.randn(4, 400).to(dtype)
    assert worst(fused.silu_mul_fused(gu), fused.silu_mul_reference(gu)) <= tol
    q, cos, sin = torch.randn(1, 7, 4, 32).to(dtype), torch.rand(1, 7, 32), torch.rand(1, 7, 32)
    assert worst(fused.rotary_fused(q.clone(), cos, sin), fused.rotary_reference(q, cos, sin)) <= tol
    heads, kv_heads, dim = 6, 2, 32  # a decode batch at different positions, grouped KV heads; batch 1 too
    for batch, positions in ((3, torch.tensor([5, 0, 9])), (1, torch.tensor([7]))):
        qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * dim).to(dtype)
        q, k, v = (t.view(batch, 1, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
        cos, sin = torch.rand(batch, 1, dim), torch.rand(batch, 1, dim)
        caches = [torch.randn(4, kv_heads, 12, dim).to(dtype) for _ in range(2)]
        caches += [c.clone() for c in caches]
        expected = fused.rope_cache_write_reference(q.clone(), k.clone(), v.clone(), cos, sin, caches[0], caches[1],
                                                    positions)
        got = fused.rope_cache_write_fused(q, k, v, cos, sin, caches[2], caches[3], positions)
        assert got.data_ptr() == q.data_ptr() and worst(got, expected) <= tol, batch  # the kernel ran: q in place
        assert worst(caches[2], caches[0]) <= tol and torch.equal(caches[3], caches[1])  # k rotated, v copied
        assert torch.equal(caches[2][:, :, 1:5], caches[0][:, :, 1:5])  # nothing else written
print("ok")
'''


def test_triton_kernels_match_the_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
