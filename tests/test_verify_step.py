"""The `Verify` step (speculative decoding's check): T tokens for each of several cache rows scored in
one forward give, position by position, the logits and the KV cache that T decode steps give."""

import pytest
import torch

from pipeline.llm.model import Decode, KVCache, Prefill, RotaryTables, Verify
from pipeline.llm.loading import load_decoder

CONTEXT = 512


@pytest.fixture(scope="module", params=["demo/qwen2-tiny", "demo/qwen-v1-tiny"])
def model(request, qwen_v1_demo, qwen2_demo):
    """GQA + qkv bias (Qwen2), and Qwen v1's logn scaling past its 256 trained positions."""
    return load_decoder(qwen2_demo if request.param == "demo/qwen2-tiny" else qwen_v1_demo)


def ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, 600, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("lengths", [(20, 33), (300, 7)])
def test_a_verify_step_gives_the_logits_and_cache_of_as_many_decode_steps(model, lengths):
    config, rope = model.config, RotaryTables(model.config, CONTEXT + 1, "cpu")
    cache = KVCache(config, 2, CONTEXT + 1, torch.float32, "cpu")
    prompts = [ids(row, n) for row, n in enumerate(lengths)]
    drafted = torch.stack([ids(10 + row, 5) for row in (0, 1)])
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):
            model(cache, rope, Prefill(row, 0), tokens=prompt[None])
        stepped = KVCache(config, 2, CONTEXT + 1, torch.float32, "cpu")
        stepped.k.copy_(cache.k)
        stepped.v.copy_(cache.v)
        starts, tables = torch.tensor(lengths), torch.zeros(2, dtype=torch.long)
        verified = model(cache, rope, Verify(starts, tables, CONTEXT), tokens=drafted, last_only=False)
        one_by_one = torch.stack([model(stepped, rope, Decode(starts + t, tables, CONTEXT),
                                        tokens=drafted[:, t:t + 1])[:, -1] for t in range(drafted.shape[1])], dim=1)
    assert verified.shape == one_by_one.shape == (2, 5, config.vocab_size)
    torch.testing.assert_close(verified, one_by_one, rtol=1e-4, atol=1e-4)
    for row, n in enumerate(lengths):  # the drafted positions' keys and values, as decode wrote them
        torch.testing.assert_close(cache.k[:, row, :, :n + 5], stepped.k[:, row, :, :n + 5], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[:, row, :, :n + 5], stepped.v[:, row, :, :n + 5], rtol=1e-5, atol=1e-5)
