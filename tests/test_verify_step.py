"""One forward per engine step: T tokens for each of several cache rows (speculative decoding's check)
give, position by position, the logits and the KV cache that T decode steps give; and decode rows with
prompt chunks in the same forward give each part what its own forward gives."""

import pytest
import torch

from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill, Rows, Tokens
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.model.loading import load_decoder

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
            model(cache, rope, (Prefill(row, 0),), tokens=prompt[None])
        stepped = KVCache(config, 2, CONTEXT + 1, torch.float32, "cpu")
        stepped.k.copy_(cache.k)
        stepped.v.copy_(cache.v)
        starts, tables = torch.tensor(lengths), torch.zeros(2, dtype=torch.long)
        verified = model(cache, rope, (Rows(starts, tables, CONTEXT, per_row=5),), tokens=drafted.reshape(1, -1))
        verified = verified.view(2, 5, -1)
        one_by_one = torch.stack([model(stepped, rope, (Rows(starts + t, tables, CONTEXT),), tokens=drafted[None, :, t])[0]
                                  for t in range(drafted.shape[1])], dim=1)
    assert verified.shape == one_by_one.shape == (2, 5, config.vocab_size)
    torch.testing.assert_close(verified, one_by_one, rtol=1e-4, atol=1e-4)
    for row, n in enumerate(lengths):  # the drafted positions' keys and values, as decode wrote them
        torch.testing.assert_close(cache.k[:, row, :, :n + 5], stepped.k[:, row, :, :n + 5], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[:, row, :, :n + 5], stepped.v[:, row, :, :n + 5], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["prefill", "tokens"])
def test_decode_rows_and_a_prompt_chunk_in_one_forward_give_what_their_own_forwards_give(model, kind):
    """Rows 0 and 1 decode while row 2 reads the second chunk of its prompt: the one forward's logits and
    cache equal a decode step's and the chunk's own forward's (a `Prefill` read eagerly, or `Tokens` as a
    CUDA graph replays them, each token's place a tensor, padded with tokens that read nothing)."""
    config, rope = model.config, RotaryTables(model.config, CONTEXT + 1, "cpu")
    cache = KVCache(config, 3, CONTEXT + 1, torch.float32, "cpu")
    prompts, reading = [ids(row, n) for row, n in enumerate((20, 290))], ids(7, 40)
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):
            model(cache, rope, (Prefill(row, 0),), tokens=prompt[None])
        model(cache, rope, (Prefill(2, 0),), tokens=reading[None, :25])
        apart = KVCache(config, 3, CONTEXT + 1, torch.float32, "cpu")
        apart.k.copy_(cache.k)
        apart.v.copy_(cache.v)
        starts, tables, next_ids = torch.tensor([20, 290]), torch.zeros(2, dtype=torch.long), ids(9, 2)
        decoded = model(apart, rope, (Rows(starts, tables, CONTEXT),), tokens=next_ids[None])[0]
        chunk_alone = model(apart, rope, (Prefill(2, 25),), tokens=reading[None, 25:])[0, -1]
        rows = Rows(starts, tables, CONTEXT)
        if kind == "prefill":
            part, fed, last = Prefill(2, 25, 0, 15), reading[25:], 2 + 14
        else:  # padded to 16 tokens: the padding one writes the scratch position and reads nothing
            positions = torch.tensor([*range(25, 40), CONTEXT])
            lengths = torch.tensor([*range(26, 41), 0])
            part = Tokens(torch.full((16,), 2), positions, torch.zeros(16, dtype=torch.long), lengths, CONTEXT + 1)
            fed, last = torch.cat([reading[25:], torch.zeros(1, dtype=torch.long)]), 2 + 14
        both = model(cache, rope, (rows, part), tokens=torch.cat([next_ids, fed])[None],
                     outputs=torch.tensor([0, 1, last]))[0]
    torch.testing.assert_close(both[:2], decoded, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[2], chunk_alone, rtol=1e-4, atol=1e-4)
    for row, n in ((0, 21), (1, 291), (2, 40)):
        torch.testing.assert_close(cache.k[:, row, :, :n], apart.k[:, row, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[:, row, :, :n], apart.v[:, row, :, :n], rtol=1e-5, atol=1e-5)
