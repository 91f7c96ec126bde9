"""Tiny built-in demo checkpoints: deterministic random weights in the real on-disk formats.

They let the app start anywhere (no GPU, no weights, no network) and go through exactly the
loaders real checkpoints use. Their text is meaningless: the weights are random.

- `demo/qwen-v1-tiny`: a Qwen v1 folder (`transformer.h.N.*`, `qwen.tiktoken`, logn + dynamic NTK).
- `demo/qwen2-tiny`: a Qwen2 transformers folder (GQA, qkv bias, `tokenizer.json` + chat template).
- `demo/llama-tiny`: a LLaMA transformers folder with a SentencePiece-style byte-fallback vocabulary
  (`▁` for spaces, `<0xNN>` byte tokens, `<s>`/`</s>`): the Vicuna stand-in for image chat.
All vocabularies are BPE-trained by `tokenizers` on `assets/demo_corpus.txt` (English, Chinese,
emoji, code), so multi-byte characters really are split across tokens, as in the real ones.
Here, above `model/` rather than in `weights/`: the random weights are a fresh `Decoder`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from filelock import FileLock

from pipeline.files import atomic_folder
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.text.tokenizer import (ENDOFTEXT, IM_END, IM_START, QWEN_PAT_STR, QWEN_SPECIALS, byte_level_alphabet,
                                         write_tiktoken_ranks)
from pipeline.llm.weights.checkpoint import write_checkpoint_files
from pipeline.llm.weights.config import DecoderConfig

CORPUS = Path(__file__).resolve().parents[2] / "assets" / "demo_corpus.txt"
BPE_VOCAB = 640
SEED = 1234
# Qwen2.5's way of writing tools (our own template, the same prompt layout): the functions as JSON in
# the system turn, calls as <tool_call>{"name", "arguments"}</tool_call>, results as <tool_response>.
QWEN2_TOOLS_TEMPLATE = (
    "{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' %}"
    "<|im_start|>system\n{{ system }}"
    "{% if tools %}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "{% endif %}<|im_end|>\n"
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% for call in m['tool_calls'] %}{% set call = call['function'] %}"
    "{% if m['content'] or not loop.first %}\n{% endif %}<tool_call>\n{\"name\": \"{{ call['name'] }}\", "
    "\"arguments\": {{ call['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEMO_VERSION = "2"  # bumped when a demo checkpoint's files change: older builds in the cache are rebuilt
DEMO_MODELS = ("demo/qwen-v1-tiny", "demo/qwen2-tiny", "demo/llama-tiny")


def _train_bpe(special_tokens: list[str]):
    """Byte-level BPE with Qwen's pre-tokenizer pattern, trained on the demo corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.read_text().splitlines(keepends=True), trainer)
    return tok


def _qwen_v1_tokenizer(folder: Path) -> int:
    """Write `qwen.tiktoken`; returns the vocabulary size including Qwen's 208 special tokens."""
    unicode_to_byte = {u: b for b, u in byte_level_alphabet().items()}
    vocab = _train_bpe([]).get_vocab()
    ranks = {bytes(unicode_to_byte[c] for c in piece): rank for piece, rank in vocab.items()}
    write_tiktoken_ranks(folder / "qwen.tiktoken", ranks)
    return len(ranks) + len(QWEN_SPECIALS)


def _qwen2_tokenizer(folder: Path) -> int:
    """Write `tokenizer.json` + `tokenizer_config.json` (ChatML template) like a Qwen2 folder."""
    tok = _train_bpe([ENDOFTEXT, IM_START, IM_END])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END, "pad_token": ENDOFTEXT,
        "model_max_length": 1024, "chat_template": QWEN2_TOOLS_TEMPLATE,
    }, indent=2))
    ids = [tok.token_to_id(t) for t in (IM_END, ENDOFTEXT)]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return tok.get_vocab_size()


def _llama_tokenizer(folder: Path) -> int:
    """SentencePiece-style BPE as LLaMA/Vicuna ship it in `tokenizer.json`: byte tokens are ordinary
    vocabulary entries (ids 3..258), only <unk>, <s>, </s> are special."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizer
    trainer_tok.train_from_iterator(CORPUS.read_text().splitlines(),
                                    trainers.BpeTrainer(vocab_size=BPE_VOCAB, show_progress=False,
                                                        special_tokens=["<unk>"]))
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted((p for p in model["vocab"] if p not in vocab), key=model["vocab"].get):
        vocab[piece] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 2048}, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return tok.get_vocab_size()


def _random_weights(config: DecoderConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    model = Decoder(config)
    with torch.no_grad():  # give the norms and biases some spread, as trained ones have
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name == "embed.weight":
                p.normal_(0, 1.0)
    return model.state_dict()


def _build(name: str, folder: Path) -> None:
    if name == "demo/llama-tiny":
        vocab, fmt = _llama_tokenizer(folder), "hf"
        config = DecoderConfig(family="llama", vocab_size=-(-vocab // 64) * 64, hidden_size=64, intermediate_size=128,
                               num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, max_position_embeddings=2048)
    else:
        qwen_v1 = name == "demo/qwen-v1-tiny"
        vocab = _qwen_v1_tokenizer(folder) if qwen_v1 else _qwen2_tokenizer(folder)
        fmt = "qwen" if qwen_v1 else "hf"
        config = DecoderConfig(
            family="qwen" if qwen_v1 else "qwen2", vocab_size=-(-vocab // 64) * 64, hidden_size=64,
            intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=4 if qwen_v1 else 2, head_dim=16,
            max_position_embeddings=32768 if qwen_v1 else 1024, rope_theta=10000.0, qkv_bias=True,
            logn_attn=qwen_v1, dynamic_ntk=qwen_v1, seq_length=256 if qwen_v1 else 0,
        )
    write_checkpoint_files(folder, config, _random_weights(config), fmt)
    (folder / "demo_version").write_text(DEMO_VERSION)


def demo_model_dir(name: str, cache_dir: Path) -> Path:
    """The demo checkpoint's folder, built once into the cache (atomically, one builder at a time)."""
    if name not in DEMO_MODELS:
        raise KeyError(name)
    folder = Path(cache_dir) / "demo" / name.split("/", 1)[1]
    if _current(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not _current(folder):
            with atomic_folder(folder) as tmp:
                _build(name, tmp)
    return folder


def _current(folder: Path) -> bool:
    stamp = folder / "demo_version"
    return (folder / "config.json").is_file() and stamp.is_file() and stamp.read_text() == DEMO_VERSION
