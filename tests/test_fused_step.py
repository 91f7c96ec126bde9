"""The fused decode step (every Triton kernel of `plugins/fused.py` and `plugins/decode_attention.py`,
run on the CPU through Triton's interpreter) against the unfused torch step on the same fp32 weights,
through the engine as the app runs it: the same greedy tokens and logits within fp32 rounding.
On a GPU, `bench/decode_limit.py` compares them in bf16 against an fp32 copy (the bf16 noise)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import torch
from plugins import decode_attention, fused
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.engine.torch_engine import TorchLLMEngine
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.prompt import Prompt

fused._use_triton = decode_attention._use_triton = lambda x: True  # the interpreter runs them on CPU tensors
configs = [
    DecoderConfig(family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=512, qkv_bias=True),
    DecoderConfig(family="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2,
                  num_kv_heads=2, head_dim=32, max_position_embeddings=512),
]
for config in configs:
    torch.manual_seed(0)
    weights = Decoder(config, fused.REFERENCE).state_dict()
    outputs = []
    for kernels in (fused.REFERENCE, fused.FUSED):
        model = Decoder(config, kernels)
        model.load_state_dict(weights)
        engine = TorchLLMEngine(model.eval(), 256, config.vocab_size, max_batch=2, rows=4)
        streams = [engine.submit(Prompt(tuple(range(s, s + 9 + 4 * s))), SamplingParams(max_new_tokens=16, temperature=0,
                                 repetition_penalty=1.0), set(), keep_logits=True) for s in (1, 2)]  # a batch of two rows
        outputs.append([(list(s), torch.stack(s.logits)) for s in streams])
        engine.close()
    for (tokens, logits), (fused_tokens, fused_logits) in zip(*outputs):
        assert len(tokens) == 16 and fused_tokens == tokens, (config.family, tokens, fused_tokens)
        assert torch.allclose(fused_logits, logits, rtol=1e-4, atol=1e-4), (fused_logits - logits).abs().max()
print("ok")
'''


def test_the_fused_decode_step_gives_the_unfused_steps_tokens_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
