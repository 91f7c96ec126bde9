"""The two-kernel top-k/top-p sampler (`plugins/topk_sampling.py`) under Triton's interpreter against the
reference sampler (`pipeline.llm.engine.sampling.sample`): the same token for every row, with repetition
penalty, temperature, top-k, top-p and greedy rows mixed in one batch; ties go to the lower id. A small
vocabulary and 256-entry blocks keep the interpreter's sorts short; `tests/test_gpu.py` checks the
compiled kernels at Qwen's vocabulary."""

import pytest

from test_lowbit import run_interpreted

pytest.importorskip("triton", reason="Triton is not installed")

SCRIPT = r'''
import torch
from plugins import topk_sampling
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.engine.sampling import sample, sampling_columns
torch.manual_seed(0)
vocab = 500
kinds = [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
         SamplingParams(temperature=0, top_k=20, repetition_penalty=1.3),  # greedy after the penalty
         SamplingParams(temperature=1.3, top_p=0.95, top_k=32, repetition_penalty=1.0)]
params = [kinds[i % 3] for i in range(6)]
logits = torch.randn(6, vocab) * 3  # fp32: no ties, whose order torch.topk leaves open (ours: the lower id first)
logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the lower id wins, as argmax has it
seen = torch.rand(6, vocab) < 0.05
logits[4] -= 20  # all negative: the penalty multiplies them (dividing would keep the seen one best)
seen[4, logits[4].float().argmax()] = True  # the penalty changes the best entry here
columns = torch.tensor(sampling_columns(params, [0.05, 0.5, 0.95, 0.3, 0.7, 0.999], vocab), dtype=torch.float32)
got = topk_sampling.sample_top_k(logits, seen, columns, block=256)
expected = sample(logits, params, seen, columns)
assert got.tolist() == expected.tolist() and got[1] == 7, (got, expected)
assert topk_sampling.applies([20, 0], [0.7, 0.0], torch.device("cuda"))
assert not topk_sampling.applies([20, 0], [0.7, 0.7], torch.device("cuda"))  # top-k off: the reference
assert not topk_sampling.applies([33], [0.7], torch.device("cuda")) and not topk_sampling.applies([20], [0.7], torch.device("cpu"))
print("ok")
'''


def test_the_sampling_kernels_draw_the_reference_tokens_under_the_interpreter():
    run_interpreted(SCRIPT)
