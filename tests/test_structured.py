"""Structured outputs, forced tool calls, logprobs and continued replies, at the engine and model level,
on every kind of tokenizer we load (HF `tokenizers` byte-level BPE, Qwen v1 tiktoken, SentencePiece)."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import sentencepiece as spm
import torch
import transformers

from pipeline.llm.demo import CORPUS
from pipeline.llm.text.grammar import GrammarVocabulary, json_schema_grammar
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.text.structure import Structure
from pipeline.llm.text.tool_calls import ReActReader, TaggedReader
from studio.backends import load_language_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad", "calm"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "mood", "tags"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory, llama_demo):
    """The LLaMA demo with only a SentencePiece `tokenizer.model` (trained here, byte fallback)."""
    folder = tmp_path_factory.mktemp("spm-llama")
    for f in llama_demo.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f, folder / f.name)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS.read_text().splitlines()),
                                   model_prefix=str(folder / "tokenizer"), vocab_size=600, model_type="bpe",
                                   byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return folder


@pytest.fixture(scope="module", params=["qwen2 (HF tokenizers)", "qwen v1 (tiktoken)", "llama (SentencePiece)"])
def model(request, qwen2_demo, qwen_v1_demo, sentencepiece_model):
    folder = {"qwen2": qwen2_demo, "qwen v1": qwen_v1_demo, "llama": sentencepiece_model}[request.param.split(" (")[0]]
    lm = load_language_model(folder, request.param, max_context=1024)
    assert type(lm.tokenizer).__name__ == {"qwen2": "HFTokenizer", "qwen v1": "QwenTiktokenTokenizer",
                                           "llama": "SentencePieceTokenizer"}[request.param.split(" (")[0]]
    yield lm
    lm.close()


def reply_of(lm, seed: int, structure: Structure, max_new_tokens: int = 400, logprobs: int | None = None):
    """(text, tool calls, finish reason, logprobs) of one reply: chat where the model has a chat format,
    else a plain completion."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=seed,
                            repetition_penalty=1.0, logprobs=logprobs)
    if lm.tokenizer.chat_template is not None or type(lm.tokenizer).__name__ == "QwenTiktokenTokenizer":
        events = list(lm.chat([{"role": "user", "content": "Describe someone."}], params, structure=structure))
    else:
        events = list(lm.complete("A person described as JSON:", params, structure=structure))
    return ("".join(e.text for e in events), [c for e in events for c in e.tool_calls], events[-1].stats.finish_reason,
            [t for e in events for t in e.logprobs or []])


def test_json_schema_replies_validate_for_20_seeds(model):
    """Random weights would write anything; the grammar makes every reply valid for the schema, and the
    reply ends (an end id) as soon as the JSON is complete. Twenty seeds run together in the batch."""
    structure = Structure.from_openai(response_format=RESPONSE_FORMAT)
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda seed: reply_of(model, seed, structure), range(20)))
    for text, _, finish, _ in replies:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, *_ in replies}) > 15  # sampled: different objects, all valid


def test_json_object_gives_an_object(model):
    text, _, finish, _ = reply_of(model, 5, Structure.from_openai(response_format={"type": "json_object"}), 600)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # random weights may nest an object past any limit: what came must still be a JSON prefix
        assert finish == "length" and text.startswith("{")


def test_unconstrained_rows_draw_the_same_tokens_beside_grammar_rows(model):
    """Two sampled requests without a grammar give the same tokens alone and in a batch whose other
    rows are masked by grammars (they join while those run, and finish before them)."""
    engine, prompt = model.engine, Prompt(tuple(model.tokenizer.encode("Tell me something")))
    stops = model.tokenizer.eos_ids
    free = [SamplingParams(max_new_tokens=24, temperature=1.0, top_k=0, top_p=1.0, seed=s, repetition_penalty=1.0)
            for s in (7, 8)]
    alone = [list(engine.submit(prompt, p, stops)) for p in free]
    vocabulary = GrammarVocabulary(model.tokenizer, engine.vocab_size, stops)
    long_schema = {"type": "array", "items": {"type": "integer"}, "minItems": 60}  # keeps its rows busy
    constrained = [engine.submit(prompt, SamplingParams(max_new_tokens=600, temperature=1.0, seed=s), stops,
                                 grammar=vocabulary.grammar(json_schema_grammar(long_schema), "response_format"))
                   for s in range(6)]
    firsts = [iter(s) for s in constrained]
    for it in firsts:
        next(it)  # running now
    together = [list(engine.submit(prompt, p, stops)) for p in free]
    assert all(s.stats.finish_reason == "" for s in constrained), "the grammar rows must still be running"
    assert together == alone
    for s in constrained:
        s.wait()


def test_logprobs_are_the_log_softmax_of_the_engine_logits(model):
    """Each token's log-probability and its top alternatives equal log-softmax (fp32, CPU) of the logits
    the engine drew from, for two requests in one batch asking for different numbers of alternatives
    (one of them under a grammar: log-probabilities are the model's, before the mask)."""
    engine, prompt = model.engine, Prompt(tuple(model.tokenizer.encode("Tell me something")))
    stops = model.tokenizer.eos_ids
    vocabulary = GrammarVocabulary(model.tokenizer, engine.vocab_size, stops)
    streams = [engine.submit(prompt, SamplingParams(max_new_tokens=30, temperature=0.9, seed=3, logprobs=5), stops,
                             keep_logits=True),
               engine.submit(prompt, SamplingParams(max_new_tokens=30, temperature=0.9, seed=4, logprobs=0), stops,
                             keep_logits=True, grammar=vocabulary.grammar(json_schema_grammar(SCHEMA), "x"))]
    for stream, k in zip(streams, (5, 0)):
        tokens = list(stream)
        assert len(tokens) == len(stream.logprobs) > 5
        for token, logits, (logprob, top) in zip(tokens, stream.logits, stream.logprobs):
            reference = torch.log_softmax(logits.float(), -1)
            assert logprob == pytest.approx(reference[token].item(), abs=1e-5)
            values, ids = reference.topk(k)
            assert [i for i, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)


def test_required_tool_calls_have_arguments_valid_for_the_schema(model):
    """`tool_choice` required: every seed's reply is one call of a listed function whose arguments
    validate against its schema, in the model family's own format (the SentencePiece LLaMA has none)."""
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": parameters}},
             {"type": "function", "function": {"name": "now"}}]  # no parameters: no arguments
    structure = Structure.from_openai(tools, "required")
    if type(model.tokenizer).__name__ == "SentencePieceTokenizer":  # no chat format at all, let alone tools
        with pytest.raises(Exception, match="tools"):
            reply_of(model, 0, structure)
        return
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda seed: reply_of(model, seed, structure), range(20)))
    for text, calls, finish, _ in replies:
        assert len(calls) == 1 and finish == "stop", (text, calls)
        assert calls[0].name in ("forecast", "now")
        if calls[0].name == "forecast":
            jsonschema.validate(json.loads(calls[0].arguments), parameters)
        else:
            assert json.loads(calls[0].arguments) == {}
    assert {calls[0].name for _, calls, *_ in replies} == {"forecast", "now"}


@pytest.mark.parametrize("pieces", [1, 3, 7])
def test_tagged_calls_are_read_whatever_the_stream_split(pieces):
    text = ('Let me check. <tool_call>\n{"name": "forecast", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call> <tool_ca')
    reader, content, calls = TaggedReader(), "", []
    for i in range(0, len(text), pieces):
        more, got = reader.push(text[i:i + pieces])
        content, calls = content + more, calls + got
    more, got = reader.finish()
    assert content + more == "Let me check. <tool_ca" and [(c.name, json.loads(c.arguments)) for c in calls + got] \
        == [("forecast", {"city": "Oslo", "days": 2}), ("now", {})]


def test_react_replies_are_read_as_calls_or_answers():
    reader = ReActReader()
    reader.push('Thought: I need the weather.\nAction: forecast\nAction Input: {"city": "Oslo"}\nObservation:')
    thought, calls = reader.finish()
    assert thought == "I need the weather." and (calls[0].name, calls[0].arguments) == ("forecast", '{"city": "Oslo"}')
    reply = " I now know the final answer\nFinal Answer:  It is sunny. \n"
    answer = ReActReader()
    cut = reply.index(" sunny")
    assert answer.push(reply[:cut]) == ("It is", []), "the answer streams before the reply ends"
    assert answer.push(reply[cut:]) == (" sunny.", []) and answer.finish() == ("", [])
    for size in (1, 2, 3, 5, 8):  # any split: the answer, all of it, once; nothing of the Thought
        reader = ReActReader()
        pieces = [reader.push(reply[i:i + size])[0] for i in range(0, len(reply), size)]
        assert "".join(pieces) + reader.finish()[0] == "It is sunny."
    no_format = ReActReader()
    assert no_format.push("Just words") == ("", []) and no_format.finish() == ("Just words", [])


def test_an_assistant_message_last_is_continued_as_transformers_continues_it(qwen2_demo, qwen_v1_demo):
    """Qwen2's template: the same ids as transformers' `continue_final_message`; ChatML (Qwen v1): the
    turn is left open right after the text."""
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi! I am"}]
    lm = load_language_model(qwen2_demo, "q2", max_context=1024)
    reference = transformers.AutoTokenizer.from_pretrained(qwen2_demo).apply_chat_template(
        messages, continue_final_message=True, tokenize=True)
    assert list(lm.format.render(messages).ids) == list(getattr(reference, "input_ids", reference))
    v1 = load_language_model(qwen_v1_demo, "q1", max_context=1024)
    ids = list(v1.format.render(messages).ids)
    assert v1.tokenizer.decode(ids).endswith("<|im_start|>assistant\nHi! I am")
    for lm_ in (lm, v1):
        text = "".join(e.text for e in lm_.chat(messages, SamplingParams(max_new_tokens=5, temperature=0)))
        assert text  # a continuation, not an error about the last role
        lm_.close()


def test_a_plain_completion_continues_the_text_with_the_same_sampling(qwen2_demo):
    lm = load_language_model(qwen2_demo, "q2", max_context=1024)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=9, stop=("zz",), logprobs=2)
    first = [(e.text, e.logprobs) for e in lm.complete("Once upon a time", params)]
    again = [(e.text, e.logprobs) for e in lm.complete("Once upon a time", params)]
    assert [t for t, _ in first] == [t for t, _ in again] and "".join(t for t, _ in first)
    assert [t.logprob for _, lps in first for t in lps or []] == \
        pytest.approx([t.logprob for _, lps in again for t in lps or []], abs=1e-4)  # the second finds the prompt cached
    stream = lm.engine.submit(Prompt(tuple(lm.tokenizer.encode("Once upon a time"))), params, lm.tokenizer.eos_ids)
    assert b"".join(t.token for _, lps in first for t in lps or []) == \
        b"".join(lm.tokenizer.token_bytes(i) for i in stream)
    lm.close()


def test_a_grammar_that_cannot_be_built_is_a_clear_error(qwen2_demo):
    lm = load_language_model(qwen2_demo, "q2", max_context=1024)
    bad = Structure.from_openai(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}})
    with pytest.raises(Exception, match="response_format"):
        list(lm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_new_tokens=4), structure=bad))
    lm.close()


NUMBERS = {"type": "object", "properties": {
    "price": {"type": "number"}, "count": {"type": "integer"},
    "grid": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}},
    "required": ["price", "count", "grid"], "additionalProperties": False}


def test_numbers_are_bounded_where_the_schema_does_not_bound_them():
    from pipeline.llm.text.grammar import LARGEST_NUMBER, bounded_numbers

    schema = {"$defs": {"n": {"type": ["number", "null"]}}, "type": "object", "properties": {
        "a": {"type": "integer", "minimum": 3}, "b": {"anyOf": [{"type": "number", "multipleOf": 0.5}, {"$ref": "#/$defs/n"}]},
        "c": {"not": {"type": "number"}}, "d": {"type": "array", "prefixItems": [{"type": "integer"}]}}}
    got = bounded_numbers(schema)
    assert got["properties"]["a"] == {"type": "integer", "minimum": 3, "maximum": LARGEST_NUMBER}  # its own bound kept
    assert got["properties"]["b"]["anyOf"][0] == {"type": "number", "multipleOf": 0.5, "minimum": -LARGEST_NUMBER,
                                                  "maximum": LARGEST_NUMBER}
    assert got["$defs"]["n"]["multipleOf"] == 1e-10 and got["properties"]["c"] == {"not": {"type": "number"}}
    assert got["properties"]["d"]["prefixItems"][0]["maximum"] == LARGEST_NUMBER and "maximum" not in schema["$defs"]["n"]


def test_the_small_model_closes_every_schema_answer_with_numbers():
    """The real SmolLM2, asked for numbers it would write forever (one third, pi to many digits, a hundred
    trillion): without bounds a quarter of these replies wrote digits until max_tokens; bounded, each closes
    well within the tokens given, valid for the schema."""
    from pipeline.models import EMBEDDED, resolve

    lm = load_language_model(resolve(EMBEDDED, None).path, EMBEDDED, max_context=2048)
    structure = Structure.from_openai(response_format={"type": "json_schema", "json_schema": {"name": "numbers",
                                                                                              "schema": NUMBERS}})
    asks = [(seed, prompt) for prompt in ("What is 1/3 as a decimal? Answer as JSON.",
                                          "Write the number one hundred trillion, and pi to many digits.")
            for seed in range(8)]

    def ask(seed_prompt):
        seed, prompt = seed_prompt
        params = SamplingParams(max_new_tokens=400, temperature=0.0 if seed == 0 else 1.0, seed=seed)
        events = list(lm.chat([{"role": "user", "content": prompt}], params, structure=structure))
        return "".join(e.text for e in events), events[-1].stats.finish_reason

    try:
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, asks))
    finally:
        lm.close()
    for text, finish in replies:
        assert finish == "stop", text[:300]
        jsonschema.validate(json.loads(text), NUMBERS)
