"""The torch LLM engine: continuous batching, per-request results, cancellation, prefix reuse (CPU, fp32)."""

import threading
import time

import pytest
import torch

from pipeline.errors import UserError
from pipeline.llm.model.loading import load_decoder
from pipeline.llm.engine.torch_engine import TorchLLMEngine
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.engine.sampling import sample, sampling_columns
from pipeline.llm.text.prompt import Prompt

CONTEXT = 512


@pytest.fixture(scope="module", params=["demo/qwen2-tiny", "demo/qwen-v1-tiny"])
def model(request, qwen_v1_demo, qwen2_demo):
    """GQA + qkv bias (Qwen2) and Qwen v1 (logn scaling, dynamic NTK past its 256-token training length)."""
    return load_decoder(qwen2_demo if request.param == "demo/qwen2-tiny" else qwen_v1_demo)


@pytest.fixture
def engine(model):
    e = TorchLLMEngine(model, CONTEXT, model.config.vocab_size, max_batch=8, rows=8)
    yield e
    e.close()


def prompt_of(seed: int, length: int) -> Prompt:
    return Prompt(tuple(torch.randint(3, 600, (length,), generator=torch.Generator().manual_seed(seed)).tolist()))


# Six requests: different prompts, lengths and sampling; two of them long enough to cross 256
# positions (the Qwen v1 demo then rescales RoPE for that request only).
REQUESTS = [
    (prompt_of(1, 5), SamplingParams(max_new_tokens=40, temperature=0, repetition_penalty=1.0)),
    (prompt_of(2, 60), SamplingParams(max_new_tokens=25, temperature=0, repetition_penalty=1.3)),
    (prompt_of(3, 17), SamplingParams(max_new_tokens=33, temperature=0.8, top_k=20, top_p=0.9, seed=11)),
    (prompt_of(4, 280), SamplingParams(max_new_tokens=20, temperature=1.2, top_k=0, top_p=0.7, seed=12)),
    (prompt_of(5, 33), SamplingParams(max_new_tokens=45, temperature=0.5, top_k=5, top_p=1.0,
                                      repetition_penalty=1.1, seed=13)),
    (prompt_of(6, 300), SamplingParams(max_new_tokens=30, temperature=0, repetition_penalty=1.05)),
]


def run(engine, prompt, params, **kw):
    stream = engine.submit(prompt, params, stop_ids=set(), keep_logits=True, **kw)
    return list(stream), stream


def test_concurrent_requests_give_what_each_gives_alone(engine):
    alone = [run(engine, p, s) for p, s in REQUESTS]
    steps_alone = engine.steps

    # Three start together; three more join while those are decoding (continuous batching).
    streams = [engine.submit(p, s, stop_ids=set(), keep_logits=True) for p, s in REQUESTS[:3]]
    first = iter(streams[0])
    for _ in range(5):
        next(first)
    streams += [engine.submit(p, s, stop_ids=set(), keep_logits=True) for p, s in REQUESTS[3:]]
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, list(streams[i])))
               for i in range(1, 6)]
    for t in threads:
        t.start()
    rest = list(first)
    for t in threads:
        t.join()
    together = [alone[0][0][:5] + rest] + [results[i] for i in range(1, 6)]

    assert engine.steps - steps_alone < steps_alone / 2  # they really shared decode steps
    for (tokens_alone, stream_alone), tokens, stream, (_, params) in zip(alone, together, streams, REQUESTS):
        assert tokens == tokens_alone and len(tokens) == params.max_new_tokens
        assert stream.stats.finish_reason == "length"
        if params.temperature == 0:
            for a, b in zip(stream_alone.logits, stream.logits):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_cancelled_request_ends_within_a_step_and_others_finish(engine):
    long = SamplingParams(max_new_tokens=400, temperature=0, repetition_penalty=1.0)
    victim = engine.submit(prompt_of(7, 20), long, stop_ids=set())
    others = [engine.submit(p, s, stop_ids=set()) for p, s in REQUESTS[:3]]
    received = []
    for token in victim:
        received.append(token)
        if len(received) == 10:
            steps_at_cancel = engine.steps
            victim.cancel()
    assert victim.stats.finish_reason == "cancelled"
    assert len(received) <= 11 and engine.steps - steps_at_cancel <= 1
    for stream, (_, params) in zip(others, REQUESTS):
        assert len(list(stream)) == params.max_new_tokens and stream.stats.finish_reason == "length"


def test_second_turn_prefills_only_new_tokens_with_the_same_logits(engine, model):
    params = SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.0)
    turn1 = prompt_of(8, 40)
    reply, _ = run(engine, turn1, params, session="alice")
    turn2 = Prompt(turn1.ids + tuple(reply) + prompt_of(9, 15).ids)
    tokens, stream = run(engine, turn2, params, session="alice")
    # The cache holds turn 1 and the reply except its last token (drawn, never fed back).
    assert stream.stats.cached_tokens == len(turn1) + len(reply) - 1
    assert stream.stats.prefilled_tokens == 15 + 1

    fresh = TorchLLMEngine(model, CONTEXT, model.config.vocab_size, max_batch=1)
    full_tokens, full = run(fresh, turn2, params)
    fresh.close()
    assert full.stats.cached_tokens == 0 and tokens == full_tokens
    for a, b in zip(full.logits, stream.logits):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_a_different_prompt_falls_back_to_a_full_prefill(engine):
    params = SamplingParams(max_new_tokens=4, temperature=0)
    run(engine, prompt_of(10, 30), params, session="bob")
    _, stream = run(engine, prompt_of(11, 30), params, session="bob")
    assert stream.stats.cached_tokens == 0  # random prompts share no prefix (first ids differ)
    _, again = run(engine, prompt_of(11, 30), params, session="bob")  # regenerate: all but the last token
    assert again.stats.cached_tokens == 29


def test_idle_sessions_are_reclaimed_least_recently_used(model):
    engine = TorchLLMEngine(model, CONTEXT, model.config.vocab_size, max_batch=2, rows=3)
    params = SamplingParams(max_new_tokens=3, temperature=0)
    for name in ("a", "b", "c"):
        run(engine, prompt_of(ord(name), 20), params, session=name)
    run(engine, prompt_of(ord("a"), 20), params, session="a")  # touch "a": "b" is now the oldest
    run(engine, prompt_of(200, 20), params, session="d")  # shares no prefix, needs a row: evicts "b"
    assert run(engine, prompt_of(ord("a"), 20), params, session="a")[1].stats.cached_tokens == 19
    assert run(engine, prompt_of(ord("c"), 20), params, session="c")[1].stats.cached_tokens == 19
    assert run(engine, prompt_of(ord("b"), 20), params, session="b")[1].stats.cached_tokens == 0
    engine.close()


def test_more_requests_than_the_batch_queue_and_all_finish(model):
    engine = TorchLLMEngine(model, CONTEXT, model.config.vocab_size, max_batch=2, rows=2)
    params = SamplingParams(max_new_tokens=6, temperature=0)
    streams = [engine.submit(prompt_of(20 + i, 10), params, stop_ids=set()) for i in range(5)]
    assert all(len(list(s)) == 6 for s in streams)
    engine.close()


def test_stop_ids_end_a_request_and_prompts_that_cannot_fit_are_refused(engine):
    params = SamplingParams(max_new_tokens=30, temperature=0, repetition_penalty=1.0)
    tokens = list(engine.submit(prompt_of(12, 10), params, stop_ids=set()))
    stream = engine.submit(prompt_of(12, 10), params, stop_ids={tokens[3]})
    assert list(stream) == tokens[:tokens.index(tokens[3])] and stream.stats.finish_reason == "stop"
    with pytest.raises(UserError, match="does not fit"):
        engine.submit(prompt_of(13, CONTEXT), params, stop_ids=set())


def test_a_reply_ends_at_the_context_end(model):
    engine = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=1)
    tokens, stream = run(engine, prompt_of(14, 50), SamplingParams(max_new_tokens=100, temperature=0))
    assert stream.stats.finish_reason == "context" and 50 + len(tokens) == 64
    engine.close()


def test_abandoned_stream_is_cancelled_and_the_engine_goes_idle(engine):
    stream = engine.submit(prompt_of(15, 10), SamplingParams(max_new_tokens=400, temperature=0), stop_ids=set())
    next(iter(stream))
    stream.cancel()
    deadline = time.time() + 10
    while engine.scheduler.running and time.time() < deadline:
        time.sleep(0.01)
    assert not engine.scheduler.running and stream.wait().finish_reason == "cancelled"


def test_batched_draws_follow_each_rows_own_parameters():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]] * 4)
    seen = torch.zeros(4, 4, dtype=torch.bool)
    seen[3, 1] = True  # penalised: 3.0 / 2.5 = 1.2 < 2.0
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1, top_k=1),
              SamplingParams(temperature=1, top_k=0, top_p=0.01), SamplingParams(temperature=0, repetition_penalty=2.5)]
    for u in (0.0, 0.5, 0.999):
        columns = torch.tensor(sampling_columns(params, [u] * 4, vocab=4))
        assert sample(logits, params, seen, columns).tolist() == [1, 1, 1, 2]
    two = [SamplingParams(temperature=1, top_k=2, top_p=1)]
    draws = {int(sample(logits[:1], two, seen[:1], torch.tensor(sampling_columns(two, [u / 200], vocab=4))))
             for u in range(200)}
    assert draws == {1, 2}


def _reference_draw(logits: torch.Tensor, seen: torch.Tensor, p: SamplingParams, u: float) -> int:
    """One row through transformers' own logits processors, then inverse-CDF over the kept tokens."""
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    ids = seen.nonzero()[:, 0][None]
    x = logits[None].clone()
    if p.repetition_penalty != 1.0 and ids.numel():
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    x = TopPLogitsWarper(p.top_p)(ids, x)
    probs = x[0].softmax(-1)
    order = probs.argsort(descending=True, stable=True)
    cdf = probs[order].cumsum(0)
    return int(order[min(int(torch.searchsorted(cdf, u * cdf[-1])), len(order) - 1)])


@pytest.mark.parametrize("mixed", [False, True])
def test_draws_match_transformers_processors_row_by_row(mixed):
    """The batched draw (top-k rows sorted within k only; rows without top-k over the whole vocabulary)
    against transformers' repetition penalty, temperature, top-k and top-p, row by row."""
    gen = torch.Generator().manual_seed(3)
    vocab, rows = 500, 24
    logits = torch.randn(rows, vocab, generator=gen) * 3
    seen = torch.rand(rows, vocab, generator=gen) < 0.05
    params = [SamplingParams(temperature=[0.5, 0.7, 1.3][i % 3], top_k=[20, 1, 50, 7][i % 4],
                             top_p=[0.8, 0.95, 0.3][i % 3], repetition_penalty=[1.05, 1.0, 1.3][i % 3])
              for i in range(rows)]
    if mixed:
        params[5] = SamplingParams(temperature=0.9, top_k=0, top_p=0.9)
    for trial in range(5):
        uniforms = torch.rand(rows, generator=gen).tolist()
        columns = torch.tensor(sampling_columns(params, uniforms, vocab))
        drawn = sample(logits, params, seen, columns).tolist()
        expected = [_reference_draw(logits[i], seen[i], p, u) for i, (p, u) in enumerate(zip(params, uniforms))]
        assert drawn == expected, trial


def test_an_engine_thread_that_fails_tells_every_request_queued_or_to_come(qwen2_demo, monkeypatch):
    """A failure past the requests' own guards (here the thread's set-up, as a CUDA error there would) ends the
    request already queued with the reason, and a later one is refused at once with it: none waits for ever."""
    from pipeline.llm.engine.model_runner import ModelRunner

    submitted = threading.Event()

    def failing_set_up(self):
        submitted.wait()
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ModelRunner, "enter_thread", failing_set_up)
    model = load_decoder(qwen2_demo)
    engine = TorchLLMEngine(model, 256, model.config.vocab_size, use_cuda_graphs=False)
    queued = engine.submit(Prompt((5, 6, 7)), SamplingParams(max_new_tokens=4), set())
    submitted.set()
    engine._thread.join()
    with pytest.raises(UserError, match="stopped .* restart the app"):
        engine.submit(Prompt((5, 6, 7)), SamplingParams(max_new_tokens=4), set())
    with pytest.raises(UserError, match=r"the language model stopped \(RuntimeError: CUDA error: an illegal"):
        list(queued)
    assert queued.stats.finish_reason == "error"
    engine.close()
