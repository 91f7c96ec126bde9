"""GGUF weights as the file stores them (`plugins/gguf_matmul.py`, `pipeline/llm/weights/gguf_native.py`), on the
CPU through Triton's interpreter (TRITON_INTERPRET=1), against gguf-py, the llama.cpp project's own reader:

- every block type the kernels run, dequantized inside the kernel (the embedding's lookup, from the same
  decoding the products use), equals gguf-py's dequantization bit for bit, on random blocks in which every
  bit pattern of quants and sub-scales occurs;
- batch invariance: each row's fp32 sums through 2–16 rows on the tensor-core kernel equal its sums in any
  other such call bit for bit, at any position, and through 2–9 rows on the one-row kernel (a verify step,
  `rows_as_one_row`) its one-row sums (one type of each decoding: the rows' loop is the same for all);
  split-K and gated with a bias too (compared before the bf16 rounding, which would hide a changed order of
  adding); the products equal the dequantized weights' within the output's rounding, one row and prefill
  (more than 16 rows) included;
- a Q4_K_M file as llama.cpp's quantizer lays it out (its per-tensor rules and fallbacks: Q5_0, Q8_0, Q4_K
  and Q6_K, a q/k/v of two types) loads with its blocks as stored, takes about the file's size, gives the
  logits of its dequantized float weights within bf16's rounding; so does a Q4_K_M that llama.cpp's own
  quantizer made (`fixtures/`), which the app's loader (`--quant gguf`) serves through the engine.
On a GPU, `bench/gguf_native.py --parts kernels` runs the same checks (and the speed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader

pytest.importorskip("triton", reason="Triton is not installed")
from test_gguf import bpe_vocab, cache  # noqa: F401, E402  (the vocabulary, and the test cache for `locate`)
from test_gguf_mixes import write_mix  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

BLOCKS = r'''
import numpy as np, torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference
from test_gguf import random_blocks
from plugins.gguf_blocks import FORMATS
from plugins.gguf_matmul import Config, GGUFWeight
from plugins.lowbit import Workspace
rng = np.random.default_rng(0)
torch.manual_seed(0)

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
'''

DEQUANTIZE = BLOCKS + r'''
for kind in FORMATS:
    rows, cols = 24, 512
    raw = random_blocks(kind, rows, cols, rng)
    want = torch.from_numpy(np.array(reference(raw, GGMLQuantizationType[kind]), np.float32)).reshape(rows, cols)
    weight = GGUFWeight.from_raw(torch.from_numpy(raw), kind, cols, None, Workspace(torch.device("cpu")))
    ids = torch.tensor([[5, 0, 23], [7, 7, 1]])
    got = weight.dequantize_rows(ids)
    assert got.shape == (2, 3, cols) and torch.equal(got, want[ids]), (kind, (got - want[ids]).abs().max())
print("ok")
'''

INVARIANT = BLOCKS + r'''
from plugins.lowbit import rows_as_one_row
for kind in FORMATS:
    # 8 blocks of 32 a row, or 2 super-blocks of 256 (the K types): every split of every config has 1 block or more
    # (the interpreter's time goes by blocks and programs)
    rows, cols = 64, 512 if FORMATS[kind].size == 256 else 256
    raw = random_blocks(kind, rows, cols, rng)
    want = torch.from_numpy(np.array(reference(raw, GGMLQuantizationType[kind]), np.float32)).reshape(rows, cols)
    configs = ((torch.bfloat16, False, Config(32, 2)), (torch.bfloat16, True, Config(64, 1)),
               (torch.float16, False, Config(64, 4)))
    # every type ungated in bf16; gated and fp16 (the same code paths for every type: the epilogue, the output
    # dtype) on one type of each decoding (4-bit blocks of 32, K types, Q6_K's 6 bits) to keep CI's time
    for dtype, gated, config in configs if kind in ("Q4_0", "Q4_K", "Q6_K") else configs[:1]:
        bias = torch.randn(rows).to(dtype) if gated or dtype == torch.float16 else None
        weight = GGUFWeight.from_raw(torch.from_numpy(raw), kind, cols, bias, Workspace(torch.device("cpu")), gated)
        weight.config, weight.one_row = config, Config(config.block_n, 3 - config.split_k % 3)
        x = torch.randn(20, cols).to(dtype)
        width = rows // 2 if gated else rows

        def exact(rows_in):  # the fp32 sums themselves (a bf16 output would hide a different order of adding)
            return weight(rows_in, torch.empty(len(rows_in), width))

        together = exact(x[:16])  # the tensor-core kernel: any 2–16 rows give each row the same numbers
        for m, start in ((2, 0), (5, 7), (2, 14), (16, 0)):  # at the tile's first, middle and last places; all 16
            assert torch.equal(exact(x[start:start + m]), together[start:start + m]), (kind, dtype, gated, m, start)
        # the one-row kernel's rows (the same loop for every type, as above): bf16 ungated on one type of each
        # decoding; gated and fp16 (the epilogue, the inputs' loads: the same for every type) on Q4_0
        if kind in ("Q4_0", "Q4_K", "Q6_K") and (kind == "Q4_0" or config == configs[0][2]):
            one = torch.cat([exact(x[i:i + 1]) for i in range(9)])
            with rows_as_one_row():  # a verify step (1 + 8 drafts: launches of 2 rows and a last one; 1 + 1 at an
                for m, start in ((9, 0), (2, 7)):  # offset): each row gets its one-row numbers
                    assert torch.equal(exact(x[start:start + m]), one[start:start + m]), (kind, dtype, gated, m, start)
        expected = x.float() @ want.T + (bias.float() if bias is not None else 0)
        if gated:
            expected = torch.nn.functional.silu(expected[:, :rows // 2]) * expected[:, rows // 2:]
        tol = 6e-3 if dtype == torch.bfloat16 else 1e-3  # the output's rounding (gated: twice)
        for got in (weight(x[:16]), weight(x), torch.cat([weight(x[i:i + 1]) for i in range(3)])):  # 16, 20 (prefill's
            assert rel(got, expected[:len(got)]) < tol * (2 if gated else 1), (kind, dtype, gated, len(got))  # tiles), 1
        assert not weight.workspace.counters.any()  # split-K left its counters at zero
print("ok")
'''

MIX = r'''
import dataclasses, sys, torch
from pathlib import Path
from plugins.gguf_matmul import GGUFWeight
from pipeline.llm.model.loading import load_decoder, load_gguf_native
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.weights.gguf_native import GGUFLinear
folder, ids, want_kinds, served = Path(sys.argv[1]), [int(i) for i in sys.argv[2].split(",")], set(sys.argv[3].split(",")), \
    sys.argv[4] == "served"

def logits(model, dtype):
    cache = KVCache(model.config, 1, len(ids), dtype, "cpu")
    with torch.inference_mode():
        return model(cache, RotaryTables(model.config, len(ids), "cpu"), (Prefill(0, 0),),
                     tokens=torch.tensor([ids]))[0].float()

native = load_gguf_native(folder, torch.bfloat16, torch.device("cpu"))
layers = [m for m in native.modules() if isinstance(m, GGUFLinear)]
for run in (r for m in layers for r in m.runs if isinstance(r, GGUFWeight)):  # tiles of 256 rows, not the GPU's 64:
    run.config = dataclasses.replace(run.config, block_n=256)  # the interpreter's time goes by programs (each runs
    # the same code; tiles of 64, split or not, are checked bit for bit by the invariance test), the split as chosen
kinds = {r.kind for m in layers for r in m.runs}
assert kinds == want_kinds, kinds  # the file's types, each as stored
assert any(len(m.runs) == 2 for m in layers)  # a q/k/v of two types (its v in a "more bits" layer)
assert native.layers[0].mlp.w_gate_up.applies_silu_mul
stored = sum(m.nbytes for m in layers) + native.embed.table.nbytes
want = logits(load_decoder(folder, torch.float32), torch.float32)
err = [((got - want).norm() / want.norm()).item()
       for got in (logits(native, torch.bfloat16), logits(load_decoder(folder, torch.bfloat16), torch.bfloat16))]
if served:  # the app's loader with --quant gguf (on the CPU only under the interpreter), a reply through the engine
    from pipeline.llm.engine.params import SamplingParams
    from pipeline.llm.text.prompt import Prompt
    from studio.backends import load_language_model
    lm = load_language_model(folder, "tiny-Q4_K_M", "torch", "cpu", torch.bfloat16, max_context=64, max_batch=1,
                             quant="gguf", speculate="off")
    assert "Q4_K_M blocks as stored" in lm.description, lm.description
    reply = lm.engine.submit(Prompt(tuple(ids[:8])), SamplingParams(max_new_tokens=2, temperature=0), set())
    assert len(list(reply)) == 2
    lm.close()  # its engine thread ends before the interpreter does
print(f"{err[0]} {err[1]} {stored}")
'''


def run_interpreted(script: str, *args: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_each_block_type_dequantized_inside_the_kernel_equals_gguf_py():
    assert run_interpreted(DEQUANTIZE) == "ok"


def test_a_rows_output_does_not_depend_on_the_others_and_products_match_the_file_weights():
    assert run_interpreted(INVARIANT) == "ok"


def test_a_q4_k_m_mix_runs_as_stored_with_the_logits_of_its_float_weights(tmp_path, bpe_vocab):
    from pipeline.models import locate
    from test_gguf import IDS

    path = tmp_path / "tiny-Q4_K_M.gguf"
    write_mix(path, bpe_vocab, "Q4_K_M")
    err, float_err, stored = run_interpreted(MIX, str(locate(str(path)).path), ",".join(map(str, IDS)),
                                             "Q5_0,Q8_0,Q4_K,Q6_K", "-").split()
    # bf16 activations through 8 random layers part from float32 by about 8 % (measured: the file's weights as
    # a bf16 float model 0.080, as stored 0.075): within that, not a wrong block (which is off by about 1)
    assert float(err) < 1.5 * float(float_err) < 0.2, (err, float_err)
    matrices = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if len(t.shape) == 2)
    assert matrices <= int(stored) <= 1.03 * matrices, (stored, matrices)  # the K types' sub-scales as bytes


def test_a_q4_k_m_file_made_by_llama_cpps_quantizer_runs_as_stored():
    """`fixtures/qwen2-tiny-Q4_K_M.gguf`: llama.cpp's own `llama-quantize` made its blocks (its scale search,
    its per-tensor types; `fixtures/make_q4_k_m.py`), so no code of ours wrote the file the kernels read: a
    Qwen2 with q/k/v biases, as stored, against its float weights as gguf-py dequantizes them."""
    from pipeline.models import locate
    from test_gguf import IDS

    path = ROOT / "tests" / "fixtures" / "qwen2-tiny-Q4_K_M.gguf"
    types = {t.name: GGMLQuantizationType(t.tensor_type).name for t in GGUFReader(path).tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["blk.1.attn_v.weight"] == "Q6_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    kinds = ",".join(sorted({k for n, k in types.items() if n.endswith("weight") and "norm" not in n}))
    err, float_err, stored = run_interpreted(MIX, str(locate(str(path)).path), ",".join(str(i % 600) for i in IDS),
                                             kinds, "served").split()
    assert float(err) < 1.5 * float(float_err) < 0.2, (err, float_err)
    matrices = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if len(t.shape) == 2)
    assert matrices <= int(stored) <= 1.03 * matrices, (stored, matrices)
