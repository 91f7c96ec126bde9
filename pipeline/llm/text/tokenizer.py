"""Tokenizers behind one small interface: Qwen v1's tiktoken vocabulary and HF `tokenizers`.

Both expose each token's raw bytes, so streaming detokenization is one mechanism for all models
(an incremental UTF-8 decoder over bytes, in `streaming.py`), and a Chinese character split across
three byte tokens is never shown half-done.
"""

from __future__ import annotations

import base64
import json
import unicodedata
from abc import ABC, abstractmethod
from pathlib import Path

import tiktoken

from pipeline.errors import UserError
from pipeline.llm.text.chat_template import ChatTemplate

# Qwen v1 (tokenization_qwen.py): pre-tokenizer pattern and special tokens, numbered right after
# the mergeable ranks (151643 of them in qwen.tiktoken, so <|endoftext|> is 151643).
QWEN_PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
QWEN_SPECIALS = (ENDOFTEXT, IM_START, IM_END) + tuple(f"<|extra_{i}|>" for i in range(205))


class Tokenizer(ABC):
    """What the pipelines need from a tokenizer; user text never turns into special tokens."""

    chat_template: str | None = None
    bos_id: int | None = None  # a beginning-of-sequence token the model expects first (LLaMA's <s>)

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special-token spellings inside `text` stay ordinary text."""

    @abstractmethod
    def special_id(self, token: str) -> int | None:
        """Id of a special token such as `<|im_end|>`, or None when the vocabulary lacks it."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Ids below this are real tokens; a model's embedding table is often padded past it."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a special token: its spelling)."""

    @property
    @abstractmethod
    def special_ids(self) -> set[int]:
        """Control tokens, never shown to the user."""

    @property
    @abstractmethod
    def eos_ids(self) -> set[int]:
        """Ids that end a reply for this model, whatever the prompt format."""

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def render_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        raise NotImplementedError

    @property
    def template_takes_tools(self) -> bool:
        return False


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A `.tiktoken` file: one `base64(token) rank` pair per line."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def write_tiktoken_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    lines = (f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda x: x[1]))
    Path(path).write_text("\n".join(lines) + "\n")


class QwenTiktokenTokenizer(Tokenizer):
    """Qwen v1 (Qwen-7B-Chat): `qwen.tiktoken` + its special tokens, NFC-normalised like the original."""

    def __init__(self, vocab_file: Path):
        ranks = read_tiktoken_ranks(vocab_file)
        self.specials = {tok: len(ranks) + i for i, tok in enumerate(QWEN_SPECIALS)}
        self._enc = tiktoken.Encoding("qwen", pat_str=QWEN_PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=self.specials)
        self._special_bytes = {i: t.encode() for t, i in self.specials.items()}

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special=set(), disallowed_special=())

    def special_id(self, token: str) -> int | None:
        return self.specials.get(token)

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    def token_bytes(self, token_id: int) -> bytes:
        special = self._special_bytes.get(token_id)
        return special if special is not None else self._enc.decode_single_token_bytes(token_id)

    @property
    def special_ids(self) -> set[int]:
        return set(self.specials.values())

    @property
    def eos_ids(self) -> set[int]:
        return {self.specials[ENDOFTEXT]}


def generation_eos_ids(folder: Path) -> set[int]:
    """The extra end-of-reply ids a checkpoint's `generation_config.json` names (LLaMA-3, Qwen2 chat)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return set()
    extra = json.loads(path.read_text()).get("eos_token_id")
    return set(extra if isinstance(extra, list) else [extra] if extra is not None else [])


def piece_bytes(piece: str, special: bool, byte: bool) -> bytes:
    """A SentencePiece-style piece's bytes: a special token's spelling, a `<0xNN>` byte-fallback piece's
    byte, else the text with `▁` as a space."""
    if special:
        return piece.encode()
    return bytes([int(piece[3:5], 16)]) if byte else piece.replace("\u2581", " ").encode()


class ByteTableTokenizer(Tokenizer):
    """A tokenizer whose subclass fills `_bytes` (each id's bytes, made once) and `_eos` at load."""

    _bytes: list[bytes]
    _eos: set[int]

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    @property
    def eos_ids(self) -> set[int]:
        return self._eos


def byte_level_alphabet() -> dict[int, str]:
    """Byte-level BPE's byte → character map (GPT-2's): printable Latin-1 bytes stand for themselves, the
    other 68 are shifted past 255 in byte order, so every vocabulary piece is printable text."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(shifted)}


def _token_text(value: object) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string or an AddedToken object."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object")
    return data


def _chat_template_source(folder: Path, config: dict) -> str | None:
    """`chat_template.jinja` (newer folders), else the config's template (or its "default" of several), else
    `chat_template.json`'s (where a processor keeps it: SmolVLM's and other vision-language folders)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    source = config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) else None


class HFTokenizer(ByteTableTokenizer):
    """A `tokenizer.json` (the `tokenizers` library, as transformers' fast tokenizers run it) with a
    byte-level (Qwen2/3) or byte-fallback (LLaMA) vocabulary, its `tokenizer_config.json` special
    tokens, and its chat template (`pipeline.llm.text.chat_template`). transformers is not imported: it is
    the slowest import of a launch."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        try:
            spec = (folder / "tokenizer.json").read_text(encoding="utf-8")
            self._tok = Backend.from_str(spec)  # parses special-token spellings: rendered templates
            self._plain = Backend.from_str(spec)  # keeps them text: user text
        except Exception as e:  # noqa: BLE001 - the Rust parser's errors are plain Exceptions
            raise UserError(f"cannot load the tokenizer in {folder}: {str(e).splitlines()[0] if str(e) else e}; "
                            "re-download tokenizer.json") from None
        self._plain.encode_special_tokens = True
        config = _read_json(folder / "tokenizer_config.json")
        named = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
        named = {key: text for key, text in named.items() if text is not None}
        extra = [t for t in map(_token_text, config.get("additional_special_tokens") or []) if t is not None]
        added = self._tok.get_added_tokens_decoder()
        self._added = {t.content: i for i, t in added.items()}
        self._specials = {i for i, t in added.items() if t.special} | \
            {i for i in map(self._tok.token_to_id, [*named.values(), *extra]) if i is not None}
        adds_bos = "bos_token" in named and config.get("add_bos_token") is not False  # GGUF files say false
        self.bos_id = self._tok.token_to_id(named["bos_token"]) if adds_bos else None
        eos = self._tok.token_to_id(named["eos_token"]) if "eos_token" in named else None
        self._eos = ({eos} if eos is not None else set()) | generation_eos_ids(folder)
        decoder = self._tok.decoder
        self._bytes = self._byte_table(json.loads(decoder.__getstate__()) if decoder is not None else {})
        source = _chat_template_source(folder, config)
        self.chat_template = source
        self._template = None
        if source is not None:
            self._template = ChatTemplate(source, named | {"additional_special_tokens": extra})

    def _byte_table(self, decoder: dict) -> list[bytes]:
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        pieces = {i: p for p, i in self._tok.get_vocab(with_added_tokens=True).items()}
        size = max(pieces, default=-1) + 1
        if "ByteLevel" in kinds:
            char_to_byte = {c: b for b, c in byte_level_alphabet().items()}

            def to_bytes(i: int, piece: str) -> bytes:
                if i in self._specials or piece in self._added:
                    return piece.encode()
                return bytes(char_to_byte[c] for c in piece) if all(c in char_to_byte for c in piece) else piece.encode()
        elif "ByteFallback" in kinds:
            def to_bytes(i: int, piece: str) -> bytes:
                byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
                return piece_bytes(piece, i in self._specials, byte)
        else:
            raise UserError(f"unsupported tokenizer decoder {sorted(map(str, kinds))}: need byte-level or "
                            "byte-fallback BPE")
        return [to_bytes(i, pieces[i]) if i in pieces else b"" for i in range(size)]

    def encode(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def special_id(self, token: str) -> int | None:
        return self._added.get(token)

    @property
    def special_ids(self) -> set[int]:
        return set(self._specials)

    def render_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The checkpoint's own chat template, tokenized with special tokens parsed (as transformers
        does, so a user typing `<|im_end|>` here types a special)."""
        if self._template is None:
            raise UserError("this model has no chat template")
        return self._tok.encode(self._template.render(messages, tools), add_special_tokens=False).ids

    @property
    def template_takes_tools(self) -> bool:
        return self._template is not None and self._template.takes_tools


class SentencePieceTokenizer(ByteTableTokenizer):
    """A SentencePiece `tokenizer.model` (LLaMA / Vicuna folders that ship no `tokenizer.json`), run by
    the `sentencepiece` library itself, as Meta's LLaMA code runs it: no conversion to another format,
    so the ids are the model's own. Pieces map to bytes as SentencePiece defines them: `▁` is a space,
    `<0xNN>` a raw byte (byte fallback)."""

    def __init__(self, path: Path):
        try:
            import sentencepiece
        except ImportError:
            raise UserError(f"{path} is a SentencePiece model: pip install sentencepiece") from None
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise UserError(f"cannot read {path}: {str(e).splitlines()[0]}; re-download it") from None
        sp = self._sp
        self._specials = {i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
        self._bytes = [piece_bytes(sp.id_to_piece(i), i in self._specials, sp.is_byte(i))
                       for i in range(sp.get_piece_size())]
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        self._eos = ({sp.eos_id()} if sp.eos_id() >= 0 else set()) | generation_eos_ids(Path(path).parent)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)  # plain text: "<s>" typed by a user stays characters

    def decode(self, ids: list[int]) -> str:
        # SentencePiece drops the space its dummy prefix added in front of the first word
        return self._sp.decode([i for i in ids if i not in self._specials])

    def special_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return i if i in self._specials and self._sp.id_to_piece(i) == token else None

    @property
    def special_ids(self) -> set[int]:
        return set(self._specials)


def load_tokenizer(folder: Path) -> Tokenizer:
    folder = Path(folder)
    if (folder / "qwen.tiktoken").is_file():
        return QwenTiktokenTokenizer(folder / "qwen.tiktoken")
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder)
    if (folder / "tokenizer.model").is_file():
        return SentencePieceTokenizer(folder / "tokenizer.model")
    raise UserError(f"no tokenizer in {folder} (expected qwen.tiktoken, tokenizer.json or tokenizer.model)")
