"""The LLM engine's parts, each alone: `CacheRows` (prefixes found by content through block hashes),
the `Scheduler` (admission, prompt chunks under the step's budget, rows 0..B-1), the `ModelRunner`
(its steps match the model's own forward pass) and the `Sampler`'s draw."""

import threading
from types import SimpleNamespace

import pytest
import torch

from pipeline.llm.engine import cache_rows as cache_rows_module
from pipeline.llm.engine.cache_rows import BLOCK, CacheRows
from pipeline.llm.model.loading import load_decoder
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.engine.seam import TokenStream
from pipeline.llm.model.parts import Prefill
from pipeline.llm.engine.model_runner import ChunkRead, ModelRunner, RowsFeed
from pipeline.llm.engine.sampler import Sampler
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.engine.sampling import Draws
from pipeline.llm.engine.plan import Request
from pipeline.llm.engine.scheduler import Scheduler
from pipeline.llm.text.prompt import Prompt

CONFIG = DecoderConfig("qwen2", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=8, max_position_embeddings=256)


def rows_of(n: int = 4) -> CacheRows:
    return CacheRows(CONFIG, n, 129, CONFIG.vocab_size, torch.float32, torch.device("cpu"))


def test_a_prompt_finds_the_row_holding_its_longest_prefix_by_content():
    rows = rows_of()
    conversation = list(range(3, 3 + 3 * BLOCK + 5))  # three whole blocks and a partial one
    other = [7] * (2 * BLOCK)
    rows.hold(2, conversation, 0, "alice")
    rows.hold(3, other, 0, "bob")
    row, held = rows.claim(conversation + [50, 51], 0, session=None, first_idle=0)
    assert held == len(conversation) and rows[row].held == conversation  # the partial block counted exactly
    assert row == 0  # moved to the first idle row
    # another client's prompt with the same content finds it too; a different first block finds nothing
    assert rows.claim(other[:BLOCK + 3] + [1], 0, session="carol", first_idle=1)[1] == BLOCK + 3
    assert rows.claim([9] * 40, 0, session=None, first_idle=2)[1] == 0


def test_an_image_slot_matches_only_the_same_image_and_a_rotary_table_only_itself():
    rows = rows_of()
    with_cat = [1, 2] + [("cat-hash", i) for i in range(BLOCK * 2)] + [5, 6]
    rows.hold(3, with_cat, 0, None)
    with_dog = [1, 2] + [("dog-hash", i) for i in range(BLOCK * 2)] + [5, 6]
    assert rows.claim(with_dog, 0, None, first_idle=0)[1] == 2  # only the text before the image
    rows.hold(0, [], 0, None)
    rows.hold(3, with_cat, 1, None)  # written with another rotary table: its entries differ
    assert rows.claim(with_cat, 0, None, first_idle=0)[1] == 0


def test_a_hash_collision_costs_a_prefill_never_wrong_tokens(monkeypatch):
    rows = rows_of()
    rows.hold(1, list(range(BLOCK * 2)), 0, None)
    monkeypatch.setattr(cache_rows_module, "block_hashes", lambda sig: [1, 2][:len(sig) // BLOCK])
    rows.hold(2, list(range(100, 100 + BLOCK * 2)), 0, None)  # the same (colliding) hashes
    _, held = rows.claim(list(range(100, 100 + BLOCK * 2)) + [3], 0, None, first_idle=0)
    assert held == BLOCK * 2  # checked position by position: the right row, not the colliding one
    _, held = rows.claim(list(range(200, 200 + BLOCK * 2)), 0, None, first_idle=0)
    assert held == 0  # the colliding row was found by hash, and refused by its tokens


def test_tokens_fed_back_are_indexed_block_by_block_and_the_least_recent_idle_row_is_evicted():
    rows = rows_of(2)
    rows.hold(0, list(range(BLOCK - 1)), 0, None)
    rows.append(0, 99)  # the first block is now whole: indexed
    assert rows[0].hashes == cache_rows_module.block_hashes(rows[0].held) and len(rows[0].hashes) == 1
    assert rows.claim(list(range(BLOCK - 1)) + [99, 4], 0, None, first_idle=0)[1] == BLOCK
    rows.hold(1, [8] * BLOCK, 0, None)
    rows.release(1)
    rows.release(0)  # row 0 used last: row 1 is the older
    row, held = rows.claim([5] * 20, 0, None, first_idle=0)
    assert held == 0 and rows[row].held == [] and rows.claim([8] * BLOCK, 0, None, first_idle=1)[1] == 0


def request(length: int) -> Request:
    return Request(Prompt(tuple(range(3, 3 + length))), SamplingParams(), set(), None, TokenStream(None, False),
                   Draws(0), 0.0)


def test_the_scheduler_admits_up_to_its_batch_and_keeps_running_requests_in_the_first_rows():
    rows = rows_of(4)
    scheduler = Scheduler(2, rows)
    requests = [request(5 + i) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    joining = scheduler.next_joining()
    assert joining == requests[:2] and scheduler.waiting == requests[2:]
    for r in joining:
        scheduler.place(r, list(r.prompt.ids))
        rows.hold(r.row, list(r.prompt.ids), 0, None)
    assert [r.row for r in scheduler.prefilling] == [0, 1] and not scheduler.running
    scheduler.promote(joining[1])  # the second one read its prompt first: it moves to row 0
    scheduler.promote(joining[0])
    assert scheduler.running == [joining[1], joining[0]] and [r.row for r in scheduler.running] == [0, 1]
    assert rows[0].held == list(joining[1].prompt.ids)  # its row moved with it
    scheduler.leave(requests[0], error=False)
    assert requests[1].row == 0 and requests[0].row == -1 and scheduler.running == [requests[1]]
    assert rows[1].held == list(requests[0].prompt.ids)  # the finished request's row keeps its tokens
    assert scheduler.next_joining() == requests[2:]  # room for one more
    scheduler.leave(requests[1], error=True)
    assert rows[0].held == []  # an error leaves the row unknown: forgotten
    done = threading.Event()
    threading.Thread(target=lambda: (scheduler.next_joining() is None) and done.set()).start()
    scheduler.close()
    assert done.wait(5)


def test_prompt_chunks_share_the_steps_budget_with_the_running_decodes():
    rows = rows_of(4)
    scheduler = Scheduler(4, rows, step_tokens=10)
    requests = [request(5), request(30), request(12)]
    for r in requests:
        scheduler.place(r, list(r.prompt.ids))
    assert scheduler.chunks() == [(r, len(r.sig)) for r in requests]  # none runs: each prompt is read whole
    scheduler.promote(requests[0])
    requests[1].position = 4  # read so far
    # 9 positions beside the one running request's decode, in equal parts: the shorter prompt left first
    assert scheduler.chunks() == [(requests[1], 9), (requests[2], 4)]
    requests[1].position = 28
    assert scheduler.chunks() == [(requests[1], 30), (requests[2], 7)]
    for r in [request(1) for _ in range(9)]:  # more running requests than the budget: prompts still advance
        scheduler.running.append(r)
    assert scheduler.chunks() == [(requests[1], 29)]
    # a GPU's graphs compute all of max_batch's rows beside prompt tokens: the budget counts those rows
    padded = Scheduler(4, rows_of(4), step_tokens=10, padded_rows=4)
    padded.running, padded.prefilling, requests[1].position = [requests[0]], requests[1:], 4
    assert padded.chunks() == [(requests[1], 7), (requests[2], 3)]


def test_a_running_request_that_leaves_hands_its_row_to_a_prompt_being_read():
    rows = rows_of(4)
    scheduler = Scheduler(4, rows, step_tokens=10)
    chat, other, reading = request(5), request(6), request(20)
    for r in (chat, other, reading):
        scheduler.place(r, list(r.prompt.ids))
        rows.hold(r.row, list(r.prompt.ids)[:3], 0, None)
    scheduler.promote(chat)
    scheduler.promote(other)
    assert reading.row == 2
    reading.position = 3
    scheduler.leave(chat, error=False)
    assert [r.row for r in scheduler.running] == [0] and reading.row == 1  # the rows in use stay 0..2
    assert rows[1].held == list(reading.prompt.ids)[:3]  # its positions moved with it
    scheduler.leave(reading, error=False)  # cancelled while reading: its row keeps what it read
    assert reading.row == -1 and rows[1].held == list(reading.prompt.ids)[:3] and scheduler.prefilling == []


def test_the_model_runners_steps_continue_its_prefill_like_one_forward_pass(qwen2_demo):
    model = load_decoder(qwen2_demo)
    vocab = model.config.vocab_size
    runner = ModelRunner(model, 64, vocab, max_batch=2, use_cuda_graphs=False)
    cache = rows_of_model(model)
    ids = [5, 9, 14, 3, 7, 22]
    prompt = Prompt(tuple(ids[:4]))
    with torch.inference_mode():
        full = model_logits(model, ids)
        _, (first,) = runner.step(cache.kv, None, [ChunkRead(prompt, 1, 0, 4, 0, logits=True)])
        assert torch.allclose(first, full[3], atol=1e-4)
        assert runner.step(cache.kv, None, [ChunkRead(prompt, 0, 0, 2, 0, logits=False)]) == (None, [])
        runner.step(cache.kv, None, [ChunkRead(prompt, 0, 2, 4, 0, logits=False)])  # in two chunks
        step, _ = runner.step(cache.kv, RowsFeed(2, [[ids[4]], [ids[4]]], [4, 4], [0, 0], kv_need=5))
        assert torch.allclose(step[0, 0], full[4], atol=1e-4) and torch.allclose(step[1, 0], full[4], atol=1e-4)
        chained, _ = runner.step(cache.kv, RowsFeed(2, chained=(torch.tensor([ids[5], ids[5]]), torch.ones(2, dtype=torch.long)),
                                                    kv_need=6))
        assert torch.allclose(chained[1, 0], full[5], atol=1e-4)  # positions one further
        sampler = Sampler(cache, vocab, max_batch=2, device=torch.device("cpu"))
        greedy = [SimpleNamespace(params=SamplingParams(temperature=0, repetition_penalty=1.0), draws=Draws(0),
                                  bias=None, grammar=None, row=row) for row in (0, 1)]
        drawn, kept, _ = sampler.draw(greedy, chained)
        assert drawn[:, 0].tolist() == [int(full[5].argmax())] * 2 and kept.tolist() == [1, 1]
        assert cache.seen[0, drawn[0, 0]]


def test_the_graph_table_holds_each_prompt_size_once_and_wide_steps_up_to_their_rows(qwen2_demo):
    """The graphs captured as an engine starts: a decode step per rows bucket, a step that reads prompt text once
    per prompt size (its rows padded to the widest bucket), and a step feeding several tokens a row per width
    for the buckets up to `wide_rows` only."""
    model = load_decoder(qwen2_demo)
    runner = ModelRunner(model, 64, model.config.vocab_size, max_batch=8, use_cuda_graphs=False, widths=(3, 5),
                         wide_rows=4, step_tokens=16)
    keys = runner.table_keys()
    assert len(keys) == len(set(keys))
    assert [k for k in keys if k[1] == 1 and not k[2]] == [(b, 1, 0) for b in (1, 2, 4, 8)]
    # the rows and prompt tokens make a power of two (the GEMMs' tiles), every size up to the largest laid out
    assert [k for k in keys if k[2]] == [(8, 1, (1 << i) - 8) for i in range(4, 10) if (1 << i) - 8 <= runner.graphed_tokens]
    laid_out = 16 + 6 * (runner.tile - 1)  # the budget, and a tile's padding at most for each chunk but the last
    assert runner.graphed_tokens >= laid_out > runner.graphed_tokens // 2 - 8
    # the last chunk's run ends in the graph's padding: 120 tokens beside the 8 rows make 128 GEMM rows, not 256
    chunk = ChunkRead(Prompt(tuple(range(1, 121))), 0, 0, 120, 0, logits=True)
    assert 120 % runner.tile and runner._text_size(len(runner._layout([chunk], tail=False)[0])) == 120
    for _, _, size in (k for k in keys if k[2]):  # the stand-ins the table is captured on lay out to its sizes
        chunks = runner._stand_in_chunks(size)
        assert runner._text_size(len(runner._layout(chunks, tail=False)[0])) == size and len(chunks) <= 8
    assert sorted(k for k in keys if k[1] > 1) == [(b, w, 0) for b in (1, 2, 4) for w in (3, 5)]


def rows_of_model(model) -> CacheRows:
    return CacheRows(model.config, 2, 65, model.config.vocab_size, torch.float32, torch.device("cpu"))


def model_logits(model, ids: list[int]) -> list[torch.Tensor]:
    """The model's last-position logits for each prefix of `ids`, each one forward pass over a fresh cache."""
    rope = ModelRunner(model, 64, model.config.vocab_size, max_batch=1, use_cuda_graphs=False).rope
    out = []
    for n in range(1, len(ids) + 1):
        cache = CacheRows(model.config, 1, 65, model.config.vocab_size, torch.float32, torch.device("cpu"))
        out.append(model(cache.kv, rope, (Prefill(0, 0, 0),), tokens=torch.tensor([ids[:n]]))[0, -1, :model.config.vocab_size])
    return out


def test_the_statistics_line_speaks_to_people_and_the_engines_terms_wait_for_verbose():
    """The UI's and terminal's line: speed, size, context; cache hits and drafts only under `--verbose`."""
    from pipeline.llm.engine.seam import GenerationStats

    stats = GenerationStats(prompt_tokens=80, cached_tokens=64, new_tokens=11, time_to_first_token_s=0.4,
                            decode_s=1.0, finish_reason="stop", drafted_tokens=4, accepted_tokens=3)
    plain = stats.summary(4096)
    assert "cache" not in plain and "draft" not in plain and "context: 91 of 4096 tokens" in plain, plain
    assert " · complete · " in plain and "ended" not in plain, plain  # why it ended, in words
    full = stats.summary(4096, engine=True)
    assert "(64 found in the cache)" in full and "drafts: 3 of 4 kept" in full and "ended: stop" in full, full
    for reason, words in (("length", "cut at the token limit"), ("cancelled", "stopped"), ("tool_calls", "ended: tool_calls")):
        assert words in GenerationStats(new_tokens=3, finish_reason=reason).summary(), reason


def test_too_little_memory_for_one_conversation_is_said_in_words_with_what_to_change():
    from pipeline.errors import UserError
    from studio.backends import cache_rows

    assert cache_rows(CONFIG, 255, torch.float32, 4, None) == (8, 4)  # on the CPU: twice the batch
    with pytest.raises(UserError, match=r"not enough memory left to hold one 255-token conversation .*lower --context"):
        cache_rows(CONFIG, 255, torch.float32, 4, kv_cache_bytes=1024)


def test_a_pictures_chunk_and_a_text_chunk_in_one_step_give_each_its_own_first_logits(qwen2_demo):
    """Where steps read text as `Tokens` (a GPU, or graphs on), a picture's chunk is a `Prefill` read after them
    in the forward: each chunk still gets its own last position's logits back, in the order it was asked in."""
    model = load_decoder(qwen2_demo)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    runner = ModelRunner(model, 64, vocab, max_batch=2, use_cuda_graphs=False)
    runner.use_cuda_graphs = True  # text as `Tokens`, as on a GPU (this step runs eagerly: it holds a picture)
    torch.manual_seed(0)
    picture = Prompt((5, 0, 0, 0, 9, 14), slots=((1, 3),), embeds=(torch.randn(3, hidden),))
    text = Prompt((7, 22, 3, 8, 11))
    with torch.inference_mode():
        cache = rows_of_model(model)
        _, both = runner.step(cache.kv, None, [ChunkRead(picture, 0, 0, 6, 0, logits=True),
                                                ChunkRead(text, 1, 0, 5, 0, logits=True)], graphed=False)
        alone = []
        for row, prompt in enumerate((picture, text)):
            cache = rows_of_model(model)
            alone += runner.step(cache.kv, None, [ChunkRead(prompt, row, 0, len(prompt), 0, logits=True)],
                                 graphed=False)[1]
    for got, want in zip(both, alone):
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
