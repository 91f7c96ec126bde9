"""The files real checkpoints bring: a SentencePiece `tokenizer.model` alone, `rope_scaling` of every kind
current configs use, sliding-window attention, LLaMA's bias options and the other config fields that
change the math. Each either matches transformers (fp32 logits, at positions past the original
context or the window) or is refused with a one-line message naming the setting."""

import json

import pytest
import torch
import transformers

from pipeline.errors import UserError
from pipeline.llm.model.loading import load_decoder
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.text.tokenizer import load_tokenizer
from conftest import train_sentencepiece

spm = pytest.importorskip("sentencepiece")

TEXTS = ["Hello world", "你好，世界！这是一个测试。", "emoji 🙂🚀 and café", "def f(x):\n    return x ** 2  # code\n\ttab",
         "trailing spaces  ", "<s> not a special </s>", "数字 12345 和 English mixed"]


@pytest.fixture(scope="module")
def sentencepiece_folder(tmp_path_factory):
    """A LLaMA-style folder with only `config.json` and a `tokenizer.model` trained here (byte fallback,
    identity normalisation, no whitespace folding: how LLaMA's own model is set up)."""
    folder = tmp_path_factory.mktemp("spm")
    train_sentencepiece(folder)
    (folder / "tokenizer.vocab").unlink()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def test_a_folder_with_only_tokenizer_model_matches_transformers_slow_and_fast(sentencepiece_folder):
    ours = load_tokenizer(sentencepiece_folder)
    fast = transformers.LlamaTokenizer.from_pretrained(sentencepiece_folder)
    slow = transformers.LlamaTokenizer.from_pretrained(sentencepiece_folder, backend="sentencepiece")
    processor = spm.SentencePieceProcessor(model_file=str(sentencepiece_folder / "tokenizer.model"))
    plain = dict(add_special_tokens=False, split_special_tokens=True)  # user text: "<s>" stays characters
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == fast.encode(text, **plain) == slow.encode(text, **plain) == processor.encode(text), text
        assert ours.decode(ids) == text == fast.decode(ids) == slow.decode(ids)
    # Leading spaces: transformers' conversion drops one ("  x" → " x"); SentencePiece itself, which the
    # model was trained with, keeps them, and so do we.
    text = "  two leading spaces"
    assert ours.encode(text) == processor.encode(text) and ours.decode(ours.encode(text)) == text
    assert fast.decode(fast.encode(text, **plain)) == text[1:]
    assert ours.bos_id == 1 and ours.eos_ids == {2} and ours.vocab_size == 600
    assert 0 in ours.special_ids and 1 in ours.special_ids and 2 in ours.special_ids
    emoji = ours.encode("🙂")
    # byte fallback; the leading space is SentencePiece's dummy prefix (the reply loop strips it)
    assert len(emoji) > 2 and b"".join(ours.token_bytes(i) for i in emoji) == " 🙂".encode()


# ---- config fields that change the math ---------------------------------------------------------

LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN2 = {**LLAMA, "num_key_value_heads": 2}


def _checkpoint(tmp_path, config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    return model


def _ours(folder, ids):
    model = load_decoder(folder)
    cache = KVCache(model.config, 1, len(ids), torch.float32, "cpu")
    with torch.inference_mode():
        return model(cache, RotaryTables(model.config, len(ids), "cpu"), (Prefill(0, 0),), tokens=torch.tensor([ids]))[0]


def _compare(tmp_path, config, length=120):
    ref = _checkpoint(tmp_path, config)
    ids = torch.randint(3, config.vocab_size, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
    got = _ours(tmp_path, ids)
    return ((got - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
     "attention_factor": 1.2},
])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rope_scaling_matches_transformers_past_the_original_context(tmp_path, arch, scaling):
    cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    config = cls(**(LLAMA if arch == "llama" else QWEN2), rope_parameters={"rope_theta": 10000.0, **scaling})
    assert _compare(tmp_path, config, length=120) <= 1e-4  # 120 positions: past the original 32 (or 256/4)


def test_a_dynamic_rope_is_refused_by_name(tmp_path):
    config = transformers.LlamaConfig(**LLAMA, rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic",
                                                                 "factor": 2.0})
    _checkpoint(tmp_path, config)
    with pytest.raises(UserError, match=r"rope_scaling type 'dynamic'"):
        read_config(tmp_path)


def test_old_style_rope_scaling_keys_are_read(tmp_path):
    """Hub configs written before transformers 5 say `rope_scaling: {"type": ...}` beside `rope_theta`."""
    cfg = {"model_type": "llama", **LLAMA, "rope_theta": 500000.0,
           "rope_scaling": {"type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = read_config(tmp_path)
    assert config.rope_theta == 500000.0 and dict(config.rope_scaling) == {"rope_type": "linear", "factor": 2.0}


def test_sliding_window_is_refused_by_name(tmp_path):
    config = transformers.Qwen2Config(**QWEN2, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    _checkpoint(tmp_path, config)
    with pytest.raises(UserError, match="use_sliding_window"):
        read_config(tmp_path)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_bias_matches_transformers(tmp_path, arch):
    if arch == "llama":
        config = transformers.LlamaConfig(**LLAMA, attention_bias=True)
    else:
        config = transformers.Qwen3Config(**LLAMA, head_dim=16, attention_bias=True)
    assert _compare(tmp_path, config) <= 1e-4


def test_mlp_bias_is_refused_by_name(tmp_path):
    _checkpoint(tmp_path, transformers.LlamaConfig(**LLAMA, mlp_bias=True))
    with pytest.raises(UserError, match="mlp_bias"):
        read_config(tmp_path)


@pytest.mark.parametrize("field, value, words", [
    ("hidden_act", "gelu", "hidden_act"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
    # AWQ/GPTQ int4 folders load (tests/test_prequantized.py); other quantizations are refused by name
    ("quantization_config", {"quant_method": "gptq", "bits": 8, "group_size": 128}, "quantization_config has bits 8"),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True},
     "quantization_config has quant_method 'bitsandbytes'"),
    ("layer_types", ["sliding_attention", "full_attention"], "layer_types"),
])
def test_other_fields_that_change_the_math_are_refused_by_name(tmp_path, field, value, words):
    cfg = {"model_type": "llama", **LLAMA, field: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=words):
        read_config(tmp_path)
