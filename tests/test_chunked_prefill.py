"""Chunked prefill: while requests run, a joining prompt is read in chunks under each step's token budget,
between their decode steps, and gives what the unchunked engine gives (CPU, fp32, the tiny demo decoders)."""

import pytest
import torch

from pipeline.llm.model.loading import load_decoder
from pipeline.llm.engine.torch_engine import TorchLLMEngine
from pipeline.llm.engine.seam import FinishReason
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.prompt import Prompt

CONTEXT = 1024
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.1)


@pytest.fixture(scope="module", params=["demo/qwen2-tiny", "demo/qwen-v1-tiny"])
def model(request, qwen_v1_demo, qwen2_demo):
    """GQA + qkv bias (Qwen2) and Qwen v1 (logn scaling, and a rotary table picked by the whole prompt's
    length: its 300-token prompt is past the 256 positions it was trained for)."""
    return load_decoder(qwen2_demo if request.param == "demo/qwen2-tiny" else qwen_v1_demo)


def engine_of(model, chunk: int | None) -> TorchLLMEngine:
    return TorchLLMEngine(model, CONTEXT, model.config.vocab_size, max_batch=4, rows=8, prefill_chunk=chunk)


def ids_of(seed: int, length: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, 600, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


def image_prompt(model) -> Prompt:
    """An image slot over positions 50..89: it crosses the chunk boundaries at 56, 63 and 64 alike."""
    embeds = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    return Prompt(ids_of(4, 120), slots=((50, 40),)).fill(embeds, "image-hash")


def alone(model, prompt: Prompt, params: SamplingParams = GREEDY) -> list[int]:
    """`prompt`'s tokens from a fresh unchunked engine."""
    engine = engine_of(model, None)
    tokens = list(engine.submit(prompt, params, set()))
    engine.close()
    return tokens


def held_rows(engine: TorchLLMEngine, sig: list) -> torch.Tensor:
    """The keys and values [2, layers, kv_heads, positions, head_dim] of `sig`'s positions, from the row
    that holds them (a later turn's row may hold more)."""
    row = next(i for i, r in enumerate(engine.rows.rows) if r.held[:len(sig)] == sig)
    return torch.stack([engine.rows.kv.k[:, row, :, :len(sig)], engine.rows.kv.v[:, row, :, :len(sig)]])


def conversation(engine: TorchLLMEngine, model) -> list[tuple[Prompt, list[int], list[torch.Tensor], int]]:
    """A long prompt joining a running chat, an image prompt, and a second turn over the first's cached
    tokens: each one's (prompt, greedy tokens, logits, cached tokens)."""
    running = engine.submit(Prompt(ids_of(1, 9)), SamplingParams(max_new_tokens=900, temperature=0), set())
    next(iter(running))  # it decodes while the others read their prompts
    first, image = Prompt(ids_of(2, 300)), image_prompt(model)
    streams = [engine.submit(p, GREEDY, set(), keep_logits=True) for p in (first, image)]
    replies = [list(s) for s in streams]
    second = Prompt(first.ids + tuple(replies[0]) + ids_of(3, 70))
    again = engine.submit(second, GREEDY, set(), keep_logits=True)
    tokens = list(again)
    running.cancel()
    running.wait()
    return [(p, t, s.logits, s.stats.cached_tokens) for p, t, s in
            zip((first, image, second), replies + [tokens], streams + [again])]


@pytest.fixture(scope="module")
def unchunked(model):
    engine = engine_of(model, None)
    results = conversation(engine, model)
    yield engine, results
    engine.close()


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_greedy_tokens_logits_and_the_kv_cache_match_the_unchunked_engine(model, unchunked, chunk):
    reference, expected = unchunked
    engine = engine_of(model, chunk)
    results = conversation(engine, model)
    for (prompt, tokens, logits, cached), (_, want, want_logits, want_cached) in zip(results, expected):
        assert tokens == want and cached == want_cached
        for a, b in zip(logits, want_logits):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        sig = prompt.signature() + tokens[:-1]  # the last token is drawn, never fed back
        ours, theirs = held_rows(engine, sig), held_rows(reference, sig)
        for position in range(len(sig)):
            torch.testing.assert_close(ours[..., position, :], theirs[..., position, :], rtol=0, atol=1e-5,
                                       msg=lambda m, p=position: f"position {p}: {m}")
    assert results[2][3] == len(results[0][0]) + len(results[0][1]) - 1  # the second turn reused the first
    engine.close()


def spy_on_prefill(engine: TorchLLMEngine, each_call) -> None:
    """Call `each_call(prompt, start, end)` on the engine thread before each step, for each prompt chunk it reads."""
    run = engine.runner.step

    def spied(cache, rows, chunks=(), *args, **kwargs):
        for c in chunks:
            each_call(c.prompt, c.start, c.end)
        return run(cache, rows, chunks, *args, **kwargs)

    engine.runner.step = spied


@pytest.mark.parametrize("chunk", [16, None])
def test_running_requests_keep_getting_tokens_while_a_long_prompt_is_read(model, chunk):
    """Counted on the engine thread at each of the long prompt's chunks: the tokens the running request
    had received. Chunked, they grow between the first chunk and the last; unchunked, the prompt is read
    in one go while the running request waits."""
    engine = engine_of(model, chunk)
    running = engine.submit(Prompt(ids_of(1, 9)), SamplingParams(max_new_tokens=400, temperature=0), set())
    long = Prompt(ids_of(2, 300))
    received = []
    spy_on_prefill(engine, lambda prompt, start, end: prompt is long and
                   received.append((start, end, running.stats.new_tokens)))
    next(iter(running))
    assert list(engine.submit(long, GREEDY, set())) == alone(model, long)
    running.cancel()
    if chunk:  # each step's budget: one position for the running request's decode, 15 for the prompt
        assert [end - start for start, end, _ in received] == [15] * 20
        # a token read at each step between (the chat's own first step, if the first chunk rides in it, has
        # no earlier step to read: one fewer)
        assert received[-1][2] - received[0][2] in (18, 19)
    else:
        assert [(start, end) for start, end, _ in received] == [(0, 300)]
    engine.close()


def test_a_request_cancelled_while_its_prompt_is_read_ends_and_keeps_what_it_read(model):
    engine = engine_of(model, 9)  # 8 positions a step beside the running chat's one
    prompt = Prompt(ids_of(6, 200))
    stream = None

    def cancel_at_the_fifth(p, start, end):
        if p is prompt and end == 40:
            stream.cancel()

    spy_on_prefill(engine, cancel_at_the_fifth)
    running = engine.submit(Prompt(ids_of(1, 9)), SamplingParams(max_new_tokens=400, temperature=0), set())
    next(iter(running))
    read_before = engine.status()["prefilled_tokens"]
    stream = engine.submit(prompt, GREEDY, set())
    assert list(stream) == [] and stream.stats.finish_reason == FinishReason.CANCELLED
    assert engine.status()["running"] == 1 and engine.status()["prefilled_tokens"] - read_before == 40
    # The row keeps the 40 positions written: the same prompt again reads only the rest, and gets the
    # unchunked engine's tokens.
    again = engine.submit(prompt, GREEDY, set())
    assert list(again) == alone(model, prompt)
    assert again.stats.cached_tokens == 40
    running.cancel()
    engine.close()


def test_a_chunk_that_fails_ends_only_its_request(model):
    """The error reaches the request whose chunk failed; the running request, whose decode step was in
    flight meanwhile and whose token rode in the failed step, takes that step again and loses no token."""
    engine = engine_of(model, 8)
    chat, long = Prompt(ids_of(1, 9)), SamplingParams(max_new_tokens=200, temperature=0)
    running = engine.submit(chat, long, set())
    failing = Prompt(ids_of(6, 100))
    beside = []

    def fail_at_the_third(p, start, end):
        if p is failing and end == 7 * 3:
            beside.extend(engine.scheduler.running)
            raise RuntimeError("the GPU fell over")

    spy_on_prefill(engine, fail_at_the_third)
    tokens = iter(running)
    first = next(tokens)
    stream = engine.submit(failing, GREEDY, set())
    with pytest.raises(RuntimeError, match="fell over"):
        list(stream)
    assert stream.stats.finish_reason == FinishReason.ERROR and len(beside) == 1  # the chat was running
    assert [first, *tokens] == alone(model, chat, long) and running.stats.finish_reason == FinishReason.LENGTH
    engine.close()


def test_a_short_prompt_is_not_queued_behind_a_long_ones_prefill(model):
    """A chat decoding, a 300-token prompt read in chunks of the step's budget (16: 15 beside the chat's
    decode), and a 10-token prompt that joins after its first chunk: from the next step they share the 15
    equally (7 and 8), so the short one is read in two steps, and answered, while the long one is still
    being read. (Before: first come first served, the short one waited for the long one's whole prefill.)
    Both replies are the unchunked engine's."""
    engine = engine_of(model, 16)
    running = engine.submit(Prompt(ids_of(1, 9)), SamplingParams(max_new_tokens=400, temperature=0), set())
    next(iter(running))
    long, short = Prompt(ids_of(2, 300)), Prompt(ids_of(3, 10))
    calls, joined = [], []

    def each_chunk(prompt, start, end):
        calls.append(("long" if prompt is long else "short", start, end))
        if prompt is long and start == 0:
            joined.append(engine.submit(short, GREEDY, set()))  # joins while the long one is read

    spy_on_prefill(engine, each_chunk)
    long_tokens = list(engine.submit(long, GREEDY, set()))
    running.cancel()
    assert list(joined[0]) == alone(model, short) and long_tokens == alone(model, long)
    shorts = [c for c in calls if c[0] == "short"]
    assert shorts == [("short", 0, 7), ("short", 7, 10)], calls[:6]
    assert calls.index(shorts[-1]) <= 4  # within two steps of joining: not after the long one's 20 chunks
    assert calls[-1][0] == "long" and calls[-1][2] == 300
    engine.close()


def test_with_nothing_running_a_short_prompt_is_answered_after_one_chunk_of_a_long_ones_read_in_a_short_step(model):
    """Nothing decoding, a 700-token prompt read in chunks of 8 × 16 = 128, and a 6-token prompt that joins
    during its first chunk: the next step reads all of the short one beside only 10 of the long one (the
    16 of a step beside running chats, not 122 of the long chunk's 128), so the short one's first token is
    drawn in the second step and that step is short (before: the long prompt was read whole, and the short one
    waited for all of it; then it waited for a long chunk beside it). Then the long one reads beside the short
    one's decode. Both replies are the unchunked engine's."""
    engine = engine_of(model, 16)
    long, short = Prompt(ids_of(4, 700)), Prompt(ids_of(5, 6))
    calls, joined = [], []

    def each_chunk(prompt, start, end):
        calls.append(("long" if prompt is long else "short", start, end))
        if prompt is long and start == 0:
            joined.append(engine.submit(short, GREEDY, set()))

    spy_on_prefill(engine, each_chunk)
    long_tokens = list(engine.submit(long, GREEDY, set()))
    assert list(joined[0]) == alone(model, short) and long_tokens == alone(model, long)
    assert calls[:4] == [("long", 0, 128), ("long", 128, 138), ("short", 0, 6), ("long", 138, 153)], calls[:5]
    engine.close()
