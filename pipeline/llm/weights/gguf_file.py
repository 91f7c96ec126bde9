"""GGUF files (llama.cpp's format, as LM Studio, Ollama, Jan and GPT4All keep models): read with the
`gguf` package (the llama.cpp project's own reader), checked, and mapped onto what the rest of the
app already reads: a transformers `config.json`, tokenizer files (`gguf_tokenizer.py`) and tensors
under transformers' names, dequantized by `gguf_quants.py`.

Why map rather than add a fourth loader: the decoder, the quantizers and their cache, the trust
check, the tokenizer and chat-template code then serve GGUF files unchanged (`gguf_folder`).

Checked before anything runs, each with one line: the magic and version (and byte order), a header
that runs past the end of the file (truncated downloads, hostile lengths), tensor data past the end, a
tensor type we do not dequantize, an architecture we do not run, a missing tensor, and every header value
the model is built from against the tensor table (`_check_against_tensors`: layer count, head counts,
widths), so a hostile header costs milliseconds, not minutes and gigabytes. Split files
(`name-00001-of-00003.gguf`) are read as one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.errors import UserError
from pipeline.llm.weights.gguf_quants import dequantize, supported

MAGIC = b"GGUF"
VERSIONS = (2, 3)
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# GGUF architecture → the `model_type` it is run as (Qwen v1 as Qwen2: its closest kin, as our converter does)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen": "qwen2"}
PER_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
             "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
             "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
             "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
             "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
             "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
             "ffn_down.weight": "mlp.down_proj.weight"}
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: str  # a `gguf_quants.supported()` type name
    shape: tuple[int, ...]  # rows first (GGUF writes the dimensions the other way round)
    data: np.ndarray  # the stored bytes (a view of the memory-mapped file)


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture's hyper-parameter (`llama.block_count`), by its key after the prefix."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise UserError(f"{self.path.name} lacks {self.architecture}.{key} in its metadata: an incomplete GGUF file")
        return value

    @property
    def matrix_types(self) -> tuple[str, ...]:
        """The types of the blocks' weight matrices (what `--quant` re-encodes), sorted."""
        return tuple(sorted({t.kind for name, t in self.tensors.items()
                             if name.startswith("blk.") and name.endswith(".weight") and len(t.shape) == 2}))

    @property
    def quant_type(self) -> str:
        """What users call its quantization (Q4_K_M), from `general.file_type` (llama.cpp's names, as the gguf
        package lists them) or its tensors."""
        from gguf import LlamaFileType

        try:
            known = LlamaFileType(int(self.metadata.get("general.file_type", -1))).name
        except (ValueError, TypeError):
            known = "GUESSED"
        if known != "GUESSED":
            return known.removeprefix("MOSTLY_").removeprefix("ALL_")
        kinds = [t.kind for t in self.tensors.values() if len(t.shape) == 2]
        return max(set(kinds), key=kinds.count) if kinds else "?"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else 'no details'}"[:160]


def _check_header(path: Path) -> None:
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if len(head) < 8:
        raise UserError(f"{path.name} is {len(head)} bytes long: not a GGUF file (truncated download?)")
    if head[:4] != MAGIC:
        raise UserError(f"{path.name} is not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
    version = int.from_bytes(head[4:8], "little")
    if version not in VERSIONS and int.from_bytes(head[4:8], "big") in VERSIONS:
        raise UserError(f"{path.name} is a big-endian GGUF file (made for IBM Z machines); this app reads the "
                        f"usual little-endian files: take the model's other download")
    if version not in VERSIONS:
        raise UserError(f"{path.name} is GGUF version {version}; this app reads versions {', '.join(map(str, VERSIONS))}")


class _Damaged(Exception):
    """What `_reader_class`'s reader finds wrong, said as the user's one line (after the file's name)."""


@functools.cache
def _reader_class():
    """`GGUFReader`, reading no byte past the end of the file: the stock one takes a short read for a
    value and goes on, so a hostile array length loops for hours and a truncated file fails with numpy's
    words; here each ends at once with ours, naming the tensor whose data is missing."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

    array = int(GGUFValueType.ARRAY)  # compared as an int: the reader calls the checks below for every item

    class Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            try:
                values = super()._get(offset, dtype, count, override_order)
            except ValueError:  # numpy's words for a few bytes too few
                values = ()
            if len(values) != count:
                raise _Damaged("the file ends inside its header (a truncated download, or a length that "
                               "points past the end); re-download it")
            return values

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == array:  # every item takes its size at least: an array's length must fit the file
                item = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
                count = int(self._get(orig_offs + 4, np.uint64)[0])
                size = 8 if item == GGUFValueType.STRING else 12 if item == GGUFValueType.ARRAY else \
                    np.dtype(self.gguf_scalar_to_np[item]).itemsize
                if count * size > len(self.data) - orig_offs - 12:
                    raise _Damaged(f"a metadata array of {count} items is longer than the file; a damaged file")
            return super()._get_field_parts(orig_offs, raw_type)

        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                name = bytes(name).decode("utf-8", "replace")
                try:
                    kind = GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise _Damaged(f"tensor {name} has type id {int(raw_type[0])}, which the gguf package does not "
                                   f"know (a damaged file, or a quantization newer than this app)") from None
                per_block, block_bytes = GGML_QUANT_SIZES[kind]
                end = start_offs + int(offset[0]) + math.prod(map(int, dims)) // per_block * block_bytes
                if end > len(self.data):
                    raise _Damaged(f"tensor {name} ends past the end of the file (truncated download?); "
                                   f"re-download it")
            super()._build_tensors(start_offs, fields)

    return Reader


def _read_one(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    from gguf import GGMLQuantizationType

    _check_header(path)
    try:
        reader = _reader_class()(path)
    except _Damaged as e:
        raise UserError(f"{path.name}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the reader's errors are ValueError/IndexError/KeyError alike
        raise UserError(f"{path.name}: damaged GGUF header ({_first_line(e)}); the file is truncated or not a "
                        f"model, re-download it") from None
    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            metadata[name] = field.contents()
        except Exception as e:  # noqa: BLE001
            raise UserError(f"{path.name}: metadata {name!r} cannot be read ({_first_line(e)}): a damaged file") from None
    tensors = {}
    for t in reader.tensors:
        kind = GGMLQuantizationType(t.tensor_type).name
        if kind not in supported():
            raise UserError(f"{path.name}: tensor {t.name} is {kind}, which this app does not load "
                            f"(it loads F32, F16, BF16 and every quantized type the gguf package reads: Q4_0 … Q8_0, "
                            f"the K, IQ and ternary types); take the model's Q4_K_M, Q8_0 or F16 file")
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        tensors[t.name] = GGUFTensor(t.name, kind, shape, t.data)
    return metadata, tensors


def split_parts(path: Path) -> list[Path]:
    """All files of a split model, given any of them (the file alone when it is not split)."""
    match = SPLIT.match(path.name)
    if not match:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['stem']}-{n:05d}-of-{count:05d}.gguf") for n in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise UserError(f"{path.name} is part of a split model whose parts {', '.join(missing)} are missing")
    return parts


def read_gguf(path: Path) -> GGUFModel:
    """The model in `path` (every part of a split one): metadata and tensors, checked; the tensors stay in
    the memory-mapped file until `hf_tensors` reads them."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist")
    metadata: dict[str, Any] = {}
    tensors: dict[str, GGUFTensor] = {}
    for part in split_parts(path):
        meta, found = _read_one(part)
        metadata = metadata or meta  # the first part holds the model's metadata
        tensors.update(found)
    model = GGUFModel(path, metadata, tensors)
    if model.architecture not in ARCHITECTURES:
        raise UserError(f"{path.name} holds a {model.architecture or 'unnamed'!r} model; this app runs GGUF "
                        f"architectures {', '.join(ARCHITECTURES)}")
    return model


def _vocab_size(model: GGUFModel) -> int:
    return int(model.tensors["token_embd.weight"].shape[0])


def hf_config(model: GGUFModel) -> dict[str, Any]:
    """The transformers `config.json` of the model in the file, from its metadata."""
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in model.tensors:
            raise UserError(f"{model.path.name} lacks tensor {name}: not a complete model")
    heads = int(model.require("attention.head_count"))
    hidden = int(model.require("embedding_length"))
    model_type = ARCHITECTURES[model.architecture]
    _check_against_tensors(model, heads, hidden)
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": _vocab_size(model),
        "hidden_size": hidden,
        "intermediate_size": int(model.require("feed_forward_length")),  # Qwen v1's too: llama.cpp halves it
        "num_hidden_layers": int(model.require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(model, heads),
        "head_dim": int(model.get("attention.key_length") or hidden // heads),
        "max_position_embeddings": int(model.get("context_length") or 4096),
        "rms_norm_eps": float(model.get("attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": float(model.get("rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "hidden_act": "silu",
    }
    if model_type == "llama" or model_type == "qwen3":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in model.tensors
    if "rope_freqs.weight" in model.tensors:
        raise UserError(f"{model.path.name} carries per-frequency RoPE factors (Llama 3.1's scaling), which this "
                        f"app does not read from GGUF files yet: take the model's transformers folder")
    scaling = model.get("rope.scaling.type")
    if scaling not in (None, "none"):
        factor = float(model.require("rope.scaling.factor"))
        original = int(model.get("rope.scaling.original_context_length") or cfg["max_position_embeddings"])
        if scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        elif scaling == "yarn":
            cfg["rope_scaling"] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        else:
            raise UserError(f"{model.path.name} uses RoPE scaling {scaling!r}, which this app does not implement")
    return cfg


def _kv_heads(model: GGUFModel, heads: int) -> int:
    """The key/value heads: as many as the query heads where the key is absent (a 0 written is a 0: the check
    refuses it by its own value)."""
    kv_heads = model.get("attention.head_count_kv")
    return heads if kv_heads is None else int(kv_heads)


def _check_against_tensors(model: GGUFModel, heads: int, hidden: int) -> None:
    """Every header value the decoder is built from, held to the tensor table before anything is built or
    read: a `UserError` naming the key and the tensor that disagree. (A `block_count` of 1,000,000 built
    layers for minutes; a `head_count` of 0 divided by zero; a wrong width failed after every tensor was
    dequantized.)"""
    name = model.path.name
    key = f"{model.architecture}."

    def wrong(what: str) -> UserError:
        return UserError(f"{name}: {what}; a damaged or hand-edited header")

    blocks = {int(m[1]) for t in model.tensors if (m := re.match(r"^blk\.(\d+)\.", t))}
    count = int(model.require("block_count"))
    if count < 1 or blocks != set(range(count)):
        raise wrong(f"{key}block_count says {count} layers, but its tensors hold "
                    f"{len(blocks)} (blk.0 … blk.{max(blocks, default=-1)})")
    kv_heads = _kv_heads(model, heads)
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise wrong(f"{key}attention.head_count {heads} and head_count_kv {kv_heads} must be positive, the first a "
                    f"multiple of the second")
    head_dim = int(model.get("attention.key_length") or hidden // heads)
    ffn = int(model.require("feed_forward_length"))
    embedding = model.tensors["token_embd.weight"].shape
    if len(embedding) != 2 or embedding[1] != hidden:
        raise wrong(f"{key}embedding_length says {hidden}, but token_embd.weight is {list(embedding)}")
    expected = {"attn_q.weight": (heads * head_dim, hidden), "attn_k.weight": (kv_heads * head_dim, hidden),
                "attn_v.weight": (kv_heads * head_dim, hidden), "attn_output.weight": (hidden, heads * head_dim),
                "attn_qkv.weight": (3 * hidden, hidden),  # Qwen v1: q, k and v in one matrix
                "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn),
                "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,), "output.weight": (embedding[0], hidden),
                "output_norm.weight": (hidden,)}
    for tensor, t in model.tensors.items():
        part = tensor.split(".", 2)[-1] if tensor.startswith("blk.") else tensor
        if part in expected and t.shape != expected[part]:
            raise wrong(f"tensor {tensor} is {list(t.shape)}, but the header ({key}embedding_length {hidden}, "
                        f"attention.head_count {heads}, head_count_kv {kv_heads}, feed_forward_length {ffn}) "
                        f"makes it {list(expected[part])}")


def _unpermute(w: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's reordering of LLaMA's q/k rows (its RoPE pairs neighbours, transformers' halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_tensors(model: GGUFModel, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Every tensor under transformers' names, dequantized to float32 (then `dtype`), one at a time."""
    return hf_tensors_as_stored(model, dtype, frozenset())[0]


def hf_tensors_as_stored(model: GGUFModel, dtype: torch.dtype | None,
                         kept: frozenset[str]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Every tensor under transformers' names: a matrix whose type is in `kept` as the file stores it, its
    bytes uint8 [rows, row bytes] (read from the file, not dequantized), the rest dequantized to float32
    (then `dtype`); and the type of each kept one, by name. Row operations (LLaMA's q/k reordering, Qwen
    v1's q/k/v split) act on stored rows as on float ones: a row's blocks hold that row alone."""
    cfg = hf_config(model)
    out: dict[str, Tensor] = {}
    kinds: dict[str, str] = {}
    for name, t in model.tensors.items():
        if t.kind in kept and len(t.shape) == 2:
            value = torch.from_numpy(np.array(t.data, np.uint8).reshape(t.shape[0], -1))
        else:
            value = dequantize(t.data, t.kind, t.shape)
            if dtype is not None:
                value = value.to(dtype)
        names: list[str] = []
        if name in GLOBAL:
            out[GLOBAL[name]] = value
            names = [GLOBAL[name]]
        elif match := re.match(r"^blk\.(\d+)\.(.+)$", name):
            layer, part = f"model.layers.{match[1]}.", match[2]
            if part.startswith("attn_qkv."):  # Qwen v1's fused q/k/v
                suffix = part.split(".", 1)[1]
                for key, piece in zip("qkv", value.chunk(3)):
                    names.append(f"{layer}self_attn.{key}_proj.{suffix}")
                    out[names[-1]] = piece.contiguous()
            elif part not in PER_LAYER:
                raise UserError(f"{model.path.name}: tensor {name} is not part of a {model.architecture} model")
            else:
                if model.architecture == "llama" and part in ("attn_q.weight", "attn_k.weight"):
                    value = _unpermute(value, cfg["num_attention_heads"] if part == "attn_q.weight"
                                       else cfg["num_key_value_heads"])
                names = [layer + PER_LAYER[part]]
                out[names[0]] = value
        if t.kind in kept and len(t.shape) == 2:
            kinds.update(dict.fromkeys(names, t.kind))
    return out, kinds
