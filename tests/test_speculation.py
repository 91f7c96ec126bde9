"""Speculative decoding: prompt lookup's drafts, the draft length each request picks, and the acceptance
rule — sampled replies keep plain decoding's distribution (a chi-square test against the exact
distribution of a tiny model's 3-token replies) and a seeded reply its very tokens. Greedy identity on
the real SmolLM2 is in test_real_model.py."""

import dataclasses
import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pipeline.llm.engine.scheduler import Proposer
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.engine.speculation import (CPU, GPU_FLOAT, LOW_BIT_MAX_ROWS, MAX_ROWS, PROBE_EVERY, DraftState,
                                             PerRequest, PromptLookup, batch_cap, best_draft, expected_tokens,
                                             prompt_lookup, Speculation, VerifyCost)
from pipeline.llm.engine.torch_engine import TorchLLMEngine
from pipeline.llm.model.loading import load_decoder
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.text.prompt import Prompt


def test_prompt_lookup_drafts_what_followed_the_latest_longest_match():
    index = PromptLookup(max_ngram=3, min_ngram=2).index()
    history = [1, 2, 3, 4, 5, 9, 2, 3]
    assert index.draft(history, 3) == [4, 5, 9]  # "2 3" last occurred at the start
    history += [4]
    assert index.draft(history, 3) == [5, 9, 2]  # "2 3 4" (the longest) there too
    history += [7, 7, 2, 3]
    assert index.draft(history, 4) == [4, 7, 7, 2]  # the latest "2 3" wins over the first
    assert index.draft(history + [8], 4) == []  # "3 8" never occurred
    slots = [5, 6, ("image", 0), 5, 6]
    assert PromptLookup().index().draft(slots, 3) == []  # an image's slot ends a draft
    fresh = PromptLookup(max_ngram=3, min_ngram=2).index()
    assert fresh.draft(history[:-1], 4, history[-1:]) == [4, 7, 7, 2]  # built at once or step by step: the same


def test_draft_length_follows_acceptance_and_pauses_where_drafts_do_not_pay():
    assert best_draft(0.9, GPU_FLOAT) == 8 and best_draft(0.3, GPU_FLOAT) in (2, 4)
    assert best_draft(0.05, CPU) == 0 and best_draft(0.9, CPU, limit=3) == 2
    state = DraftState(PromptLookup().index())
    assert state.wanted(GPU_FLOAT, 8, 100) > 0  # a new request tries at once
    for _ in range(10):
        state.record(4, 0)
    assert state.rate < 0.05
    asked = [state.wanted(GPU_FLOAT, 8, 100) for _ in range(2 * PROBE_EVERY)]
    assert asked.count(0) == 2 * PROBE_EVERY - 2 and asked[PROBE_EVERY - 1] == 2  # a short probe now and then
    for _ in range(10):
        state.record(4, 4)
    assert state.wanted(GPU_FLOAT, 8, 100) == 8 and state.wanted(GPU_FLOAT, 8, 3) == 2
    assert state.wanted(GPU_FLOAT, 4, 100) == 4
    dear = VerifyCost(0.0, 1.5)  # each drafted token costs more than a step: nothing pays, all kept or not
    assert state.whole and [state.wanted(dear, 8, 100) for _ in range(2 * PROBE_EVERY)] == [0] * 2 * PROBE_EVERY


class Running:
    """What the proposer reads of a running request: the room left to draft."""

    def __init__(self):
        self.position = 10
        self.params = SimpleNamespace(max_new_tokens=100)
        self.stream = SimpleNamespace(stats=SimpleNamespace(new_tokens=0))


def test_a_batch_drafts_only_what_pays_for_all_of_its_rows():
    """A verify step's cost is the batch's: one row's long draft makes all 8 wait. Each row alone would draft
    here, but for the batch the cap must pay over 8 plain tokens, and then by the cost model the batch's
    expected tokens per unit of cost are never below a plain step's (1 a row)."""
    eight = VerifyCost(0.15, 0.12)  # a step of 8 rows checking k drafts each: 1 + 0.15 + 0.12 k plain steps
    assert best_draft(0.5, eight) > 0  # one row by itself would draft at this rate
    one_keen = [(0.5, 4)] + [(0.0, 0)] * 7  # one chat quoting, seven not drafting
    assert batch_cap(one_keen, eight) == 0
    all_keen = [(0.9, 8)] * 8  # every chat quoting its input
    cap = batch_cap(all_keen, eight)
    assert cap == 8
    proposer = Proposer(Speculation(PromptLookup(), eight), context=1000)  # the engine's side applies it
    keen, idle = DraftState(None, accepted=1.0, checked=2.0), DraftState(None, accepted=0.0, checked=9.0)
    running = [Running() for _ in range(8)]
    proposer.states = {r: keen if i == 0 else idle for i, r in enumerate(running)}
    assert proposer.wanted(running[:1])[running[0]] > 0 and not any(proposer.wanted(running).values())
    for rows in (one_keen, all_keen, [(0.6, 4)] * 4 + [(0.1, 2)] * 4, [(0.3, 2)] * 8):
        cap = batch_cap(rows, eight)
        longest = max(min(k, cap) for _, k in rows)
        tokens = sum(expected_tokens(rate, min(k, cap)) for rate, k in rows)
        assert tokens / eight(longest) >= len(rows), (rows, cap)


@pytest.mark.parametrize("low_bit", [False, True])
def test_no_step_drafts_past_max_rows_chats(low_bit):
    """Past `max_rows` chats no row drafts, however well its drafts are kept (8 chats measured slower speculating
    than not on the H200, where the cost model said otherwise; low-bit weights already at 2 chats); up to
    `max_rows` the cost model decides. The app's GPU speculation takes 2 rows, and 1 with low-bit weights."""
    app = prompt_lookup("cuda", low_bit)
    assert app.max_rows == (LOW_BIT_MAX_ROWS if low_bit else MAX_ROWS)
    proposer = Proposer(dataclasses.replace(app, cost=VerifyCost(0.0, 0.0)), context=1000)
    running = [Running() for _ in range(app.max_rows + 1)]
    proposer.states = {r: DraftState(None, accepted=9.0, checked=9.0) for r in running}
    assert all(proposer.wanted(running[:app.max_rows]).values()) and not any(proposer.wanted(running).values())
    assert proposer.drafts(running, dict.fromkeys(running, 4), None) is None  # (settling promoted a chat since)


# ---- the acceptance rule, against the exact distribution of a tiny model -------------------------------------

PROMPT = Prompt(tuple(range(5, 25)))
PARAMS = dict(max_new_tokens=3, temperature=1.0, top_k=3, top_p=1.0, repetition_penalty=1.0)
DRAWS = 1200


@pytest.fixture(scope="module")
def model(qwen2_demo):
    return load_decoder(qwen2_demo)


@pytest.fixture(scope="module")
def tree(model) -> dict[tuple[int, ...], list[tuple[int, float]]]:
    """Each reply prefix of up to 2 tokens → its 3 possible next tokens with their probabilities under
    PARAMS (top-3 of the model's logits, renormalised), by plain forward passes."""
    config, out = model.config, {}
    rope = RotaryTables(config, 64, "cpu")

    def grow(prefix: tuple[int, ...]) -> None:
        cache = KVCache(config, 1, 64, torch.float32, "cpu")
        with torch.inference_mode():
            logits = model(cache, rope, (Prefill(0, 0),), tokens=torch.tensor([[*PROMPT.ids, *prefix]]))[0, -1]
        top = logits.topk(3)
        out[prefix] = list(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))
        if len(prefix) < 2:
            for token, _ in out[prefix]:
                grow((*prefix, token))

    grow(())
    return out


class TreeDraft(PerRequest):
    """A drafter that proposes the most likely continuation (as a greedy draft model would): half the time
    or so the model draws something else, so drafts are both kept and rejected."""

    always, name = True, "the most likely tokens"

    def __init__(self, tree):
        self.tree = tree

    def close(self) -> None:
        """Nothing held."""

    def index(self) -> "TreeDraft":
        return self

    def draft(self, history, k: int, last=()) -> list[int]:
        reply, draft = (*history[len(PROMPT.ids):], *last), []
        while len(draft) < k and (*reply, *draft) in self.tree:
            draft.append(self.tree[(*reply, *draft)][0][0])
        return draft


def replies(model, speculation, seeds, **params) -> list[tuple[int, ...]]:
    """Each seed's reply, asked a batch (MAX_ROWS: the most that draft) at a time: a queue never empty would keep a
    prompt in every step, and no step drafts while a prompt is read, so whether drafts come at all would hang on
    the machine's speed."""
    engine = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=8, rows=16, speculation=speculation)
    seeds, out = list(seeds), []
    for wave in range(0, len(seeds), MAX_ROWS):
        streams = [engine.submit(PROMPT, SamplingParams(**{**PARAMS, **params}, seed=seed), set())
                   for seed in seeds[wave:wave + MAX_ROWS]]
        out += [tuple(s) for s in streams]
    status = engine.status()
    engine.close()
    return out, status


def chi_square_bound(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty): exceeded by chance once in 1,000."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_speculative_sampling_keeps_the_distribution_and_each_seeds_tokens(model, tree):
    """1,200 seeded 3-token replies with a draft checked at each step: their counts match the exact
    probabilities of plain decoding (chi-square below its 0.999 quantile), and each seed gives the same
    tokens as plain decoding; drafts were both kept and rejected."""
    speculative, status = replies(model, Speculation(TreeDraft(tree), VerifyCost(0.0, 0.0), max_draft=2),
                                  range(DRAWS))
    assert status["verify_steps"] and 0.2 < status["accepted_tokens"] / status["drafted_tokens"] < 0.9, status
    exact = {(a, b, c): pa * pb * pc for a, pa in tree[()] for b, pb in tree[(a,)] for c, pc in tree[(a, b)]}
    counts = {reply: 0 for reply in exact}
    for reply in speculative:
        assert reply in counts, f"{reply}: a reply plain decoding never gives"
        counts[reply] += 1
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * DRAWS >= 5]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in cells if c not in big)]
    expected = [exact[c] * DRAWS for c in big] + [sum(exact[c] for c in cells if c not in big) * DRAWS]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    assert statistic < chi_square_bound(len(observed) - 1), (statistic, observed, expected)
    plain, _ = replies(model, None, range(200))
    assert speculative[:200] == plain


class RepeatDraft(PerRequest):
    """Drafts one token again and again: with a bias towards it, its drafts are often kept, and the
    penalties of the positions after a kept one decide whether it comes again."""

    always, name = True, "one token again"

    def __init__(self, token: int):
        self.token = token

    def close(self) -> None:
        """Nothing held."""

    def index(self) -> "RepeatDraft":
        return self

    def draft(self, history, k: int, last=()) -> list[int]:
        return [self.token] * k



@pytest.mark.parametrize("bias, kept", [(6.0, 60), (1.0, 20)])
def test_penalties_count_the_drafted_tokens_before_each_position(model, bias, kept):
    """With repetition, presence and frequency penalties, a drafted token kept at one position is penalised
    at the positions after it, as plain decoding penalises it, and a rejected one is not: every seed gives
    plain decoding's tokens (a strong bias: drafts mostly kept; a weak one: often rejected)."""
    token = 77
    penalties = dict(max_new_tokens=6, top_k=5, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
                     logit_bias=((token, bias),))
    speculative, status = replies(model, Speculation(RepeatDraft(token), VerifyCost(0.0, 0.0), max_draft=4),
                                  range(200), **penalties)
    plain, _ = replies(model, None, range(200), **penalties)
    assert speculative == plain
    assert status["accepted_tokens"] >= kept, status


def test_a_step_after_a_verify_step_runs_one_ahead_of_the_host_and_each_seed_keeps_plain_decoding_s_tokens(model):
    """A step that drafts nothing (here once the drafts stop paying) is launched before the host has read the verify
    step in flight (its rows' positions and last tokens follow on the device from what that step kept, here a part
    of its draft): its rows' random numbers start where the kept count says, so seeded sampled replies are plain decoding's, token for token.
    A step that drafts reads the one in flight first (its draft continues that step's text)."""
    prompt = Prompt(tuple(range(5, 35)))
    params = [SamplingParams(max_new_tokens=40, temperature=1.0, top_k=0, top_p=1.0, seed=seed) for seed in range(6)]
    plain = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=2)
    expected = [list(plain.submit(prompt, p, set())) for p in params]
    plain.close()

    class Quotes(PerRequest):  # the reply's tokens up to its 20th, then each draft's first one right, the rest wrong
        always, name = True, "a quote"

        def __init__(self, reply: list[int]):
            self.reply = reply

        def index(self):
            return self

        def close(self) -> None:
            """Nothing held."""

        def draft(self, history, k: int, last=()) -> list[int]:
            made = len(history) + len(last) - len(prompt)
            return [t if made + i < 20 or i == 0 else t + 1 for i, t in enumerate(self.reply[made:made + k])]

    for p, reply in zip(params, expected):
        engine = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=2,
                                speculation=Speculation(Quotes(reply), VerifyCost(1.0, 0.0), max_draft=3))
        behind = []  # where a step follows a verify step in flight: whether that step kept some of its draft
        draw = engine.sampler.draw
        engine.sampler.draw = lambda *args: behind.append(args[3] is not None and args[3][0].item() > 1) or draw(*args)
        assert list(engine.submit(prompt, p, set())) == reply, p.seed
        status = engine.status()
        engine.close()
        assert True in behind and 0 < status["accepted_tokens"] < status["drafted_tokens"], (behind, status)


# ---- one ask per step, and no clock -------------------------------------------------------------------------

def test_a_draft_model_is_asked_once_per_step_for_all_rows_and_drafts_them_as_one_batch(model):
    """Chats speculate with a draft model (the model drafting for itself through an engine of its own), as many
    as may draft together (MAX_ROWS): each engine step asks the drafter once, for every row that drafts, and the
    draft engine runs those drafts side by side. The replies are plain decoding's."""
    from pipeline.llm.draft_model import DraftModel

    params = SamplingParams(max_new_tokens=24, temperature=0, repetition_penalty=1.0)
    prompts = [Prompt(tuple(range(5 + i, 25 + i))) for i in range(MAX_ROWS)]
    plain = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=4)
    expected = [list(plain.submit(p, params, set())) for p in prompts]
    plain.close()
    drafter_engine = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=4)
    drafter = DraftModel(drafter_engine, "itself")
    engine = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=4, speculation=Speculation(drafter, CPU))
    calls, propose = [], drafter.propose
    drafter.propose = lambda asks: calls.append((engine.steps, len(asks))) or propose(asks)
    submitted, step = threading.Event(), engine.runner.step
    engine.runner.step = lambda *args, **kwargs: submitted.wait() and step(*args, **kwargs)
    streams = [engine.submit(p, params, set()) for p in prompts]
    submitted.set()  # the first step waits for all of them (else the first chat may end before the last joins)
    assert [list(s) for s in streams] == expected
    status = engine.status()
    engine.close()
    steps = [step for step, _ in calls]
    assert len(steps) == len(set(steps)), calls  # one call a step
    assert max(n for _, n in calls) == MAX_ROWS == drafter_engine.status()["most_running"], calls  # one batch
    assert status["accepted_tokens"] > 0 and drafter.reused > 0  # drafts from the work asked a step ahead


def test_a_draft_asked_a_step_ahead_serves_only_where_the_step_kept_its_whole_draft_and_drew_its_first(model):
    """As a step's draft is handed out, the small model starts on the next one, as if the step keeps it all.
    Where the step did, and drew the token the small model put first, the next draft is that work's; where it
    kept less, or drew another token, that work is dropped and the draft asked again. Each draft is the small
    model's greedy continuation of the text either way."""
    from pipeline.llm.draft_model import DraftModel
    from pipeline.llm.engine.speculation import Ask

    vocab, text = model.config.vocab_size, tuple(range(5, 25))
    plain = TorchLLMEngine(model, 64, vocab, max_batch=4)

    def greedy(ids, n: int) -> list[int]:
        return list(plain.submit(Prompt(tuple(ids)), SamplingParams(max_new_tokens=n, temperature=0,
                                                                    repetition_penalty=1.0), set()))

    cont = greedy(text, 12)
    drafter = DraftModel(TorchLLMEngine(model, 64, vocab, max_batch=4), "itself")
    state = drafter.index()
    assert drafter.propose([Ask(state, text[:-1], text[-1:], 3)]) == [cont[:3]] and drafter.reused == 0
    kept_all = [*text, *cont[:3]]  # the step kept the 3 and drew cont[3], the small model's first
    assert drafter.propose([Ask(state, kept_all, (cont[3],), 3)]) == [cont[4:7]] and drafter.reused == 1
    kept_one = [*kept_all, cont[3], cont[4]]  # kept 1 of cont[4:7], then drew the token the work ahead put first
    assert cont[7] != cont[5]  # (so the step kept only one: what it drew is not the draft's second)
    third = drafter.propose([Ask(state, kept_one, (cont[7],), 3)])[0]
    assert third == greedy([*kept_one, cont[7]], 3) and drafter.reused == 1  # asked again, not taken from ahead
    other = cont[7]
    kept_whole_other = [*kept_one, other, *third]  # kept all 3, then drew another token than the small model's
    other = (greedy([*kept_whole_other], 1)[0] + 1) % vocab
    assert drafter.propose([Ask(state, kept_whole_other, (other,), 2)]) == [greedy([*kept_whole_other, other], 2)]
    assert drafter.reused == 1
    drafter.forget(state)
    drafter.close()
    plain.close()


class FirstRight(PerRequest):
    """Drafts the reply's next two tokens right and the ones after them wrong, so how long a draft pays depends on
    what a verify step costs."""

    always, name = True, "first right"

    def __init__(self, prompt: Prompt, reply: list[int]):
        self.prompt, self.reply = prompt, reply

    def index(self) -> "FirstRight":
        return self

    def close(self) -> None:
        """Nothing held."""

    def draft(self, history, k: int, last=()) -> list[int]:
        made = len(history) + len(last) - len(self.prompt)
        return [t if i < 2 else t + 1 for i, t in enumerate(self.reply[made:made + k])]


def test_which_steps_verify_follows_from_the_tokens_not_from_the_clock(model):
    """Two engines, one of whose steps take 50 ms longer when they check drafts: the same steps verify,
    with the same drafts kept (a step's cost is fixed while an engine runs; the engine once timed its own
    steps, so a busy machine changed what it drafted from run to run)."""
    prompt = Prompt(tuple(range(5, 35)))
    params = SamplingParams(max_new_tokens=30, temperature=0, repetition_penalty=1.0)
    plain = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=2)
    reply = list(plain.submit(prompt, params, set()))
    plain.close()

    def run(slow: bool) -> dict:
        engine = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=2,
                                speculation=Speculation(FirstRight(prompt, reply), CPU, measured=True))
        if slow:
            step = engine.runner.step

            def slow_verify(cache, rows, *args, **kwargs):
                if rows is not None and rows.tokens is not None and len(rows.tokens[0]) > 1:
                    time.sleep(0.05)
                return step(cache, rows, *args, **kwargs)

            engine.runner.step = slow_verify
        tokens = list(engine.submit(prompt, params, set()))
        status = engine.status()
        engine.close()
        return {"tokens": tokens, **{k: status[k] for k in ("verify_steps", "drafted_tokens", "accepted_tokens")}}

    quick, slow = run(False), run(True)
    assert quick == slow and quick["tokens"] == reply and quick["verify_steps"] > 0, (quick, slow)


def test_a_step_drafts_by_what_a_verify_step_of_its_rows_costs(model):
    """A chat drafts alone, where one row's check is cheap, and nothing while two run, where a check of two
    rows costs more than the tokens it could give (low-bit weights' batch kernels: 8 rows x 9 tokens cost
    several of 8 rows' decode steps), not even a probe."""
    prompt = Prompt(tuple(range(5, 35)))
    params = SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.0)
    plain = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=2)
    reply = list(plain.submit(prompt, params, set()))
    plain.close()

    def run(chats: int) -> dict[int, list[int]]:
        """The draft lengths wanted, by how many requests ran."""
        engine = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=2,
                                speculation=Speculation(FirstRight(prompt, reply), CPU))
        engine.proposer.costs = {1: VerifyCost(0.0, 0.0), 2: VerifyCost(0.0, 2.0)}
        asked: dict[int, list[int]] = {1: [], 2: []}
        wanted = engine.proposer.wanted

        def noted(running):
            lengths = wanted(running)
            asked[len(running)] += lengths.values()
            return lengths

        engine.proposer.wanted = noted
        streams = [engine.submit(prompt, params, set()) for _ in range(chats)]
        assert [list(s) for s in streams] == [reply] * chats
        engine.close()
        return asked

    assert any(run(1)[1])
    together = run(2)[2]  # (the second may join at once or a step or two later: the same either way)
    assert len(together) >= 8 and not any(together), together


@pytest.mark.parametrize("exact", [True, False])
def test_fast_speculation_checks_one_chats_drafts_on_the_batch_kernels(model, monkeypatch, exact):
    """`--speculate exact`: one chat's every step runs its positions as one-row launches (low-bit weights
    round as in its decode steps); `fast`: its verify steps take the batch kernels, its decode steps not."""
    from plugins import lowbit

    prompt = Prompt(tuple(range(5, 35)))
    params = SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.0)
    plain = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=2)
    reply = list(plain.submit(prompt, params, set()))
    plain.close()
    one_row: list[bool] = []
    original = lowbit.rows_as_one_row
    monkeypatch.setattr(lowbit, "rows_as_one_row", lambda on: (one_row.append(on), original(on))[1])
    engine = TorchLLMEngine(model, 64, model.config.vocab_size, max_batch=2,
                            speculation=Speculation(FirstRight(prompt, reply[:8]), CPU, exact=exact))  # then plain steps
    assert list(engine.submit(prompt, params, set())) == reply
    status = engine.status()
    engine.close()
    assert status["verify_steps"] > 0 and one_row.count(True) > 0
    prompt_steps = 1  # the prompt's read: a chunk's rows take the batch kernels
    assert one_row.count(False) == prompt_steps + (0 if exact else status["verify_steps"]), (one_row, status)


def test_one_plan_one_forward_one_draw_and_one_settlement_for_every_step_kind(model):
    """A chat that drafts (half its drafts kept: rollbacks) and then no more, a second whose long prompt is read in chunks while
    the first runs, then decodes without drafts (its drafts miss, so it stops drafting): every step is a
    `StepPlan` run in one forward, drawn in one call and settled by `Outputs.settle`, whatever it holds, prompt
    chunks, a prompt's first token, decode rows and verify rows, mixed in one step too. The replies are each
    prompt's greedy reply alone, without speculation or chunks."""
    import random

    def words(seed: int, n: int) -> Prompt:  # replies of distinct tokens (a run of one token hides a wrong position)
        rng = random.Random(seed)
        return Prompt(tuple(rng.randrange(5, model.config.vocab_size) for _ in range(n)))

    first, second = words(2, 30), words(1, 100)
    params = SamplingParams(max_new_tokens=30, temperature=0, repetition_penalty=1.0)
    plain = TorchLLMEngine(model, 256, model.config.vocab_size, max_batch=2, prefill_chunk=None)
    alone = [list(plain.submit(p, params, set())) for p in (first, second)]
    plain.close()

    engine = TorchLLMEngine(model, 256, model.config.vocab_size, max_batch=2, prefill_chunk=16,
                            speculation=Speculation(FirstRight(first, alone[0][:15]), CPU))  # then no drafts
    calls = {"forward": 0, "draw": 0}
    planned: list[set[str]] = []
    settled: list[set[str]] = []

    def kinds(plan) -> set[str]:
        return {"chunk" for c in plan.chunks if not c.last} | \
            {"prompt" if s.last else "verify" if s.proposed else "decode" for s in plan.drawing}

    def spy(owner, name: str, log):
        method = getattr(owner, name)

        def spied(*args, **kwargs):
            out = method(*args, **kwargs)
            log(out if name == "plan" else args[0])
            return out

        setattr(owner, name, spied)

    spy(engine.scheduler, "plan", lambda plan: planned.append(kinds(plan)))
    spy(engine.runner, "step", lambda _: calls.update(forward=calls["forward"] + 1))
    spy(engine.sampler, "draw", lambda _: calls.update(draw=calls["draw"] + 1))
    spy(engine.outputs, "settle", lambda step: settled.append(kinds(step.plan)))
    streams = [engine.submit(first, params, set())]
    next(iter(streams[0]))  # the first chat runs before the second joins
    streams.append(engine.submit(second, params, set()))
    replies = [list(s) for s in streams]
    status = engine.status()
    engine.close()
    assert [alone[0][0], *replies[0]] == alone[0] and replies[1] == alone[1], (replies, alone)
    assert set().union(*planned) == {"chunk", "prompt", "decode", "verify"}, planned
    assert any({"prompt", "decode"} <= step or {"prompt", "verify"} <= step for step in settled), settled  # mixed
    assert calls["forward"] == calls["draw"] == len(planned), (calls, len(planned))  # every step draws here
    # every step settled: the last one too, unless its requests had all ended when it was launched
    assert len(settled) <= calls["draw"] <= len(settled) + 1 and settled == planned[:len(settled)], (settled, planned)
    assert status["verify_steps"] and 0 < status["accepted_tokens"] < status["drafted_tokens"], status


def test_verify_costs_are_kept_for_the_next_launch_and_a_damaged_record_is_measured_again(tmp_path):
    from pipeline.llm.engine.speculation import costs_on, read_costs, write_costs

    record = tmp_path / "kernels" / "verify.json"
    assert read_costs(record) is None  # a first launch: nothing recorded, measured
    costs = {1: VerifyCost(0.05, 0.01), 8: VerifyCost(0.2, 0.3)}
    write_costs(record, costs)
    assert read_costs(record) == costs
    for damaged in ("", "{", "[]", '{"1": [0.1]}', '{"x": [0.1, 0.2]}', '{"1": "ab"}'):
        record.write_text(damaged)
        assert read_costs(record) is None, damaged

    timed = []

    def seconds(rows: int, k: int, settled: bool) -> float:
        """Steps of `rows` rows: 1 + 0.1 k plain steps, their host waiting for each adding 0.05 (0.1 at 8 rows)."""
        timed.append(rows)
        return rows * (1.0 + 0.1 * k + (0.05 * (1 + (rows == 8)) if settled else 0.0))

    gpu = Speculation(PromptLookup(), GPU_FLOAT, measured=True, record=record)
    measured = costs_on(gpu, seconds, (1, 8, 1))  # the damaged record: measured again, each row count once
    assert set(timed) == {1, 8} and set(measured) == {1, 8}, (timed, measured)
    fitted = [round(x, 9) for c in (measured[1], measured[8]) for x in (c.fixed, c.per_token)]
    assert fitted == [0.05, 0.1, 0.1, 0.1], measured  # the host's wait in the fixed part
    timed.clear()
    assert costs_on(gpu, seconds, (1, 8)) == measured == read_costs(record) and not timed  # the next launch: recorded
    assert costs_on(Speculation(PromptLookup(), CPU), seconds, (1, 8)) is None and not timed  # a CPU: the prior


class StandInGraph:
    """What the runner needs of a captured CUDA graph, on the CPU: inputs copied into buffers of its own, a run
    outside the graph where asked (`warm_up`), and a replay that runs the step on them (eagerly). Each capture
    is recorded with its warm-up; a capture numbered in `refused` fails where it had no warm-up run before it
    (as one meeting lazy set-up would), or in any case where it is numbered in `broken`."""

    captured: list = []
    refused: set[int] = set()
    broken: set[int] = set()

    def __init__(self, fn, *example, pool=None, warm_up: bool = True):
        self.fn, self.inputs = fn, [x.clone() if x is not None else None for x in example]
        if warm_up:
            fn(*self.inputs)
        if len(StandInGraph.captured) in StandInGraph.broken or \
                not warm_up and len(StandInGraph.captured) in StandInGraph.refused:
            StandInGraph.refused.discard(len(StandInGraph.captured))
            raise RuntimeError("operation not permitted when stream is capturing")
        StandInGraph.captured.append((tuple(x.shape if x is not None else None for x in example), warm_up))

    def replay(self):
        return self.fn(*self.inputs)


def test_every_step_replays_a_graph_captured_before_the_engine_is_ready(model, monkeypatch):
    """The CUDA graph table on a CPU stand-in (`StandInGraph`): an engine that speculates captures its table as
    it starts, then serves a mixed run (a prompt read alone, a second joining while the first decodes, its
    chunks beside the rows, drafts checked, three chats at once) without capturing a graph or running a step
    eagerly for want of one: no capture mid-reply. The replies are those of an engine without graphs."""
    import random

    from pipeline.llm.engine import model_runner

    monkeypatch.setattr(model_runner, "CapturedCall", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    rng = random.Random(5)
    prompts = [Prompt(tuple(rng.randrange(5, model.config.vocab_size) for _ in range(n))) for n in (30, 90, 12)]

    class Repeats(PerRequest):  # drafts the last token again: verify steps, some drafts kept
        always, name = True, "repeats"

        def index(self):
            return self

        def close(self) -> None:
            """Nothing held."""

        def draft(self, history, k: int, last=()) -> list[int]:
            return [last[-1]] * k
    params = SamplingParams(max_new_tokens=24, temperature=0, repetition_penalty=1.0)

    def run(graphs: bool) -> tuple[list[list[int]], TorchLLMEngine]:
        engine = TorchLLMEngine(model, 256, model.config.vocab_size, max_batch=4, prefill_chunk=16,
                                use_cuda_graphs=graphs, speculation=Speculation(Repeats(), CPU))
        first = engine.submit(prompts[0], params, set())
        next(iter(first))
        streams = [first, *(engine.submit(p, params, set()) for p in prompts[1:])]
        replies = [list(s) for s in streams]
        engine.keys = sorted(engine.runner._graphs)
        engine.close()
        return replies, engine

    StandInGraph.captured.clear()
    graphed, engine = run(True)
    table = len(engine.runner.table_keys())
    assert engine.runner.ready and engine.runner.captures == table == len(StandInGraph.captured), \
        (engine.keys, engine.runner.table_keys())  # all of them as it started, none since
    assert [warm for _, warm in StandInGraph.captured] == [True] + [False] * (table - 1)  # one warm-up run
    assert engine.runner.missed == 0 and engine.status()["verify_steps"] > 0, engine.status()
    eager, _ = run(False)
    assert graphed == eager, (graphed, eager)


def test_a_prompt_read_beside_one_chat_in_the_widest_bucket_leaves_the_bucket_s_other_rows_idle(model, monkeypatch):
    """A graphed step that reads a prompt runs its rows in the widest bucket (one graph per prompt size). Two chats
    fill the rows and one ends; the other decodes alone for some steps, so the bucket's second row still holds
    the ended chat's last token and position, live; a third prompt then joins the first chat's chained steps, in
    that very row (the only one free), and is read over several steps. That row must write nothing there: both replies equal an engine's without graphs (CPU
    stand-in: `StandInGraph`)."""
    from pipeline.llm.engine import model_runner

    monkeypatch.setattr(model_runner, "CapturedCall", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    prompts = [Prompt(tuple(range(11 + 7 * i, 31 + 7 * i))) for i in range(2)]
    short, long = (SamplingParams(max_new_tokens=n, temperature=0, repetition_penalty=1.0) for n in (6, 120))

    def run(graphs: bool) -> tuple[list[int], list[int], TorchLLMEngine]:
        engine = TorchLLMEngine(model, 256, model.config.vocab_size, max_batch=2, rows=2, prefill_chunk=16,
                                use_cuda_graphs=graphs)
        first, ending = engine.submit(prompts[0], long, set()), engine.submit(prompts[1], short, set())
        list(ending)
        tokens = iter(first)
        ahead = [next(tokens) for _ in range(12)]  # steps of the first chat alone (a narrower bucket), chained
        joining = engine.submit(Prompt(tuple(range(40, 100))), short, set())  # over its position 25: the ended one's
        replies = ahead + list(tokens), list(joining)
        engine.close()
        return (*replies, engine)

    StandInGraph.captured.clear()
    *graphed, engine = run(True)
    assert engine.runner.missed == 0
    *eager, _ = run(False)
    assert graphed == eager, (graphed, eager)


def test_a_capture_refused_without_a_warm_up_is_retried_with_one_and_a_failed_table_leaves_eager_steps(model,
                                                                                                        monkeypatch):
    """A table capture without a warm-up run that fails (lazy set-up inside it) is made again after one, and the
    table completes; where the first capture (warmed) fails, the engine warns and runs its steps eagerly, with
    the same replies (CPU stand-in: `StandInGraph`)."""
    from pipeline.llm.engine import model_runner

    monkeypatch.setattr(model_runner, "CapturedCall", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    prompt = Prompt(tuple(range(7, 47)))
    params = SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.0)

    def run(graphs: bool, refused: set[int] = frozenset(), broken: set[int] = frozenset()):
        StandInGraph.captured.clear()
        StandInGraph.refused, StandInGraph.broken = set(refused), set(broken)
        engine = TorchLLMEngine(model, 256, model.config.vocab_size, max_batch=4, prefill_chunk=16,
                                use_cuda_graphs=graphs)
        reply = list(engine.submit(prompt, params, set()))
        engine.close()
        return reply, engine.runner

    eager, _ = run(False)
    retried, runner = run(True, refused={3})
    assert runner.captures == len(runner.table_keys()) and runner.missed == 0 and not StandInGraph.refused
    assert [warm for _, warm in StandInGraph.captured][:5] == [True, False, False, True, False]
    assert retried == eager
    with pytest.warns(UserWarning, match="capturing the step graphs failed"):
        unwarmed, runner = run(True, broken={0})
    assert runner.ready and runner.captures == 0 and runner.missed > 0 and unwarmed == eager
