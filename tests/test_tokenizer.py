"""Tokenizers: Qwen v1 tiktoken round trips and specials, HF byte-level, UTF-8-safe streaming."""

import base64

import pytest

from pipeline.llm.text.streaming import TextStream
from pipeline.llm.text.tokenizer import HFTokenizer, QwenTiktokenTokenizer, load_tokenizer

TEXTS = {
    "english": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "chinese": "你好，世界！人工智能正在改变世界。北京是中国的首都。",
    "emoji": "Party 🎉🚀 family 👨‍👩‍👧 heart ❤️ robot 🤖",
    "code": 'def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(3))\t{"a": [1, 2]}',
    "mixed": "Qwen 通义千问 says: 1+1=2 ✅ naïve café Ωmega\r\n  trailing   ",
    "special_spellings": "user typed <|im_end|> and <|endoftext|> and <|extra_3|> as plain text",
}


@pytest.fixture(scope="module", params=["qwen-v1", "qwen2"])
def tokenizer(request, qwen_v1_demo, qwen2_demo):
    return load_tokenizer(qwen_v1_demo if request.param == "qwen-v1" else qwen2_demo)


def test_demo_folders_pick_the_right_tokenizer(qwen_v1_demo, qwen2_demo):
    assert isinstance(load_tokenizer(qwen_v1_demo), QwenTiktokenTokenizer)
    assert isinstance(load_tokenizer(qwen2_demo), HFTokenizer)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip(tokenizer, name):
    ids = tokenizer.encode(TEXTS[name])
    assert ids and tokenizer.decode(ids) == TEXTS[name]


def test_special_spellings_stay_text(tokenizer):
    ids = tokenizer.encode(TEXTS["special_spellings"])
    assert not set(ids) & tokenizer.special_ids
    assert tokenizer.special_id("<|im_end|>") in tokenizer.special_ids


def test_qwen_v1_special_ids_at_real_size(tmp_path):
    """With a vocabulary of Qwen's real size (151643 ranks) the specials land on Qwen's ids."""
    singles = [bytes([b]) for b in range(256)]
    pairs = [bytes([a, b]) for a in range(256) for b in range(256)]
    triples = [bytes([97 + a % 26, a // 26 % 256, 200 + a // 6656]) for a in range(151643 - 256 - 65536)]
    lines = [f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(singles + pairs + triples)]
    (tmp_path / "qwen.tiktoken").write_text("\n".join(lines))
    tok = QwenTiktokenTokenizer(tmp_path / "qwen.tiktoken")
    assert [tok.special_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [151643, 151644, 151645]
    assert tok.special_id("<|extra_0|>") == 151646 and tok.special_id("<|extra_204|>") == 151850
    assert tok.eos_ids == {151643}
    assert tok.decode(tok.encode(TEXTS["chinese"])) == TEXTS["chinese"]


@pytest.mark.parametrize("name", ["chinese", "emoji", "mixed"])
def test_streaming_never_yields_broken_characters(tokenizer, name):
    text = TEXTS[name]
    ids = tokenizer.encode(text)
    # The test means something only if some tokens are not whole characters on their own.
    partial = [i for i in ids if _is_partial_utf8(tokenizer.token_bytes(i))]
    assert partial, "expected multi-byte characters split across tokens"
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_stop_string_split_across_tokens(tokenizer):
    ids = tokenizer.encode("The answer is 42#") + tokenizer.encode("#") + tokenizer.encode("# Human: more")
    stream = TextStream(tokenizer, stop_strings=["###"])
    out = "".join(stream.push(i) for i in ids) + stream.finish()
    assert out == "The answer is 42" and stream.stopped


def test_held_back_prefix_is_released_when_not_a_stop(tokenizer):
    stream = TextStream(tokenizer, stop_strings=["###"])
    out = "".join(stream.push(i) for i in tokenizer.encode("C# and F## are ok")) + stream.finish()
    assert out == "C# and F## are ok" and not stream.stopped


def test_control_tokens_are_not_shown(tokenizer):
    ids = tokenizer.encode("a") + [tokenizer.special_id("<|im_start|>")] + tokenizer.encode("b")
    stream = TextStream(tokenizer)
    assert "".join(stream.push(i) for i in ids) + stream.finish() == "ab"
