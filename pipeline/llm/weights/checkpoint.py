"""Read and write decoder checkpoints in the on-disk formats users have.

Formats: transformers folders (Qwen2/2.5, Qwen3, LLaMA/Vicuna; safetensors or `.bin`, single or
sharded with an index) and Qwen v1 folders (Qwen-7B-Chat: `transformer.h.N.attn.c_attn` holds
q/k/v, `mlp.w1` is up, `mlp.w2` is gate). Every format maps onto the decoder's own names
(see `model/decoder.py`), so one writer per format also gives the Qwen v1 → Qwen2 converter. The tensors
go into a `Decoder` in `model/loading.py`, above the decoder: this layer never imports it.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm

from pipeline.errors import UserError
from pipeline.files import atomic_folder
from pipeline.llm.weights.config import CONFIG_WRITERS, DecoderConfig, config_from_hf
from pipeline.llm.weights.families import QWEN_V1, Layout, family_of
from pipeline.llm.weights.gguf_file import hf_tensors, hf_tensors_as_stored, read_gguf
from pipeline.weights_io import read_json, read_weight_file

StateDict = dict[str, Tensor]


def read_config(folder: Path) -> DecoderConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in {folder}: point at a model folder (with config.json and weights)")
    return config_from_hf(read_json(path))


def _weight_files(folder: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            names = sorted(set(read_json(index).get("weight_map", {}).values()))
            return [folder / n for n in names]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return [folder / single]
    for pattern in ("*.safetensors", "*.gguf"):  # a GGUF file is linked into its folder (`gguf_folder.py`)
        found = sorted(folder.glob(pattern))
        if found:
            return found
    raise UserError(f"no weights in {folder} (expected *.safetensors or pytorch_model.bin)")


def read_tensors(folder: Path, dtype: torch.dtype | None = None) -> StateDict:
    """All tensors of a checkpoint folder, shard by shard, with a progress bar for big ones."""
    folder = Path(folder)
    files = _weight_files(folder)
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"checkpoint in {folder} is incomplete: missing {', '.join(missing)}")
    if files[0].suffix == ".gguf":  # one model, however many parts: the reader joins them
        return hf_tensors(read_gguf(files[0]), dtype)
    tensors: StateDict = {}
    for path in tqdm(files, desc=f"loading {folder.name}", unit="shard", disable=len(files) < 2):
        part = read_weight_file(path, "model weights")
        tensors.update({k: v.to(dtype) if dtype is not None and v.is_floating_point() else v
                        for k, v in part.items()})
    return tensors


def read_gguf_as_stored(folder: Path, dtype: torch.dtype, kept: frozenset[str]) -> tuple[StateDict, dict[str, str]]:
    """A GGUF model folder's tensors, its matrices of the types in `kept` as the file stores them, and their
    types by name (`gguf_file.hf_tensors_as_stored`)."""
    files = _weight_files(Path(folder))
    if files[0].suffix != ".gguf":
        raise UserError(f"{Path(folder).name} is not a GGUF file: only a GGUF file's blocks run as stored")
    return hf_tensors_as_stored(read_gguf(files[0]), dtype, kept)


def take(raw: StateDict, key: str) -> Tensor:
    try:
        return raw.pop(key)
    except KeyError:
        raise UserError(f"checkpoint lacks tensor {key!r}: wrong model type or a truncated download?") from None


def _layer_names(config: DecoderConfig, layout: Layout) -> dict[str, str]:
    """The one-to-one renames that exist for this config (no q/k-norm or bias where there is none)."""
    skip = set()
    if not config.qk_norm:
        skip |= {"attn.q_norm.weight", "attn.k_norm.weight"}
    if not config.qkv_bias:
        skip.add("attn.wqkv.bias")
    if not config.o_bias:
        skip.add("attn.wo.bias")
    return {ours: theirs for ours, theirs in layout.renames.items() if ours not in skip}


def float_linear(raw: StateDict, modules: list[str]) -> StateDict:
    """A float projection: its modules' weights (consumed from `raw`) concatenated along the outputs."""
    return {"weight": torch.cat([take(raw, m + "weight") for m in modules])}


def to_internal(config: DecoderConfig, raw: StateDict, layout: Layout,
                linear: Callable[[StateDict, list[str]], StateDict] = float_linear) -> StateDict:
    """Checkpoint tensors (consumed from `raw`) under the decoder's own names. `linear(raw, modules)`
    makes each block projection's tensors, by suffix ("weight"; a pre-quantized format's "q", "scale",
    "zero"), from the format's modules (`Layout.projections`); biases and the rest are float."""
    projections = layout.projections()
    names = {ours: theirs for ours, theirs in _layer_names(config, layout).items()
             if ours.removesuffix(".weight") not in projections}
    sd = {"embed.weight": take(raw, layout.embed), "norm.weight": take(raw, layout.norm)}
    for i in range(config.num_layers):
        p, o = layout.layer.format(i), f"layers.{i}."
        sd.update({o + ours: take(raw, p + theirs) for ours, theirs in names.items()})
        for ours, modules in projections.items():
            sd.update({f"{o}{ours}.{k}": v for k, v in linear(raw, [p + m for m in modules]).items()})
        if layout.qkv and config.qkv_bias:
            sd[o + "attn.wqkv.bias"] = torch.cat([take(raw, p + q + "bias") for q in layout.qkv])
    sd["lm_head.weight"] = sd["embed.weight"] if config.tie_word_embeddings else take(raw, "lm_head.weight")
    return sd


def from_internal(config: DecoderConfig, sd: StateDict, layout: Layout) -> StateDict:
    """The decoder's tensors under a checkpoint format's names (views: split, not copied)."""
    raw = {layout.embed: sd["embed.weight"], layout.norm: sd["norm.weight"]}
    split = [config.q_size, config.kv_size, config.kv_size]
    for i in range(config.num_layers):
        p, o = layout.layer.format(i), f"layers.{i}."
        raw.update({p + theirs: sd[o + ours] for ours, theirs in _layer_names(config, layout).items()})
        if layout.qkv:
            raw.update({p + q + "weight": w for q, w in zip(layout.qkv, sd[o + "attn.wqkv.weight"].split(split))})
            if config.qkv_bias:
                raw.update({p + q + "bias": b for q, b in zip(layout.qkv, sd[o + "attn.wqkv.bias"].split(split))})
        raw.update(zip((p + name for name in layout.gate_up), sd[o + "mlp.w_gate_up.weight"].chunk(2)))
    if not config.tie_word_embeddings:
        raw["lm_head.weight"] = sd["lm_head.weight"]
    return raw


def layout_of(config: DecoderConfig) -> Layout:
    return family_of(config.family).layout


def _contiguous(sd: StateDict) -> StateDict:
    """Own storage per tensor: safetensors refuses views and shared tensors."""
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def write_checkpoint(folder: Path, config: DecoderConfig, sd: StateDict, fmt: str,
                     max_shard_bytes: int = 4 << 30) -> None:
    """Write `sd` (decoder names) as a `fmt` ("hf" or "qwen") folder, sharding with an index past
    `max_shard_bytes`. Written to a temporary folder and renamed, so a crash leaves nothing half-done."""
    with atomic_folder(folder) as tmp:
        write_checkpoint_files(tmp, config, sd, fmt, max_shard_bytes)


def write_checkpoint_files(folder: Path, config: DecoderConfig, sd: StateDict, fmt: str,
                           max_shard_bytes: int = 4 << 30) -> None:
    """`write_checkpoint`'s files, written into the existing `folder` (for callers that add more files
    to it and make the whole folder atomic themselves)."""
    if fmt not in CONFIG_WRITERS:
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    cfg = CONFIG_WRITERS[fmt](config)
    raw = _contiguous(from_internal(config, sd, family_of(cfg["model_type"]).layout))
    cfg["torch_dtype"] = str(sd["embed.weight"].dtype).removeprefix("torch.")
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, t in raw.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in raw.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


TOKENIZER_FILES = ("qwen.tiktoken", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "generation_config.json", "vocab.json", "merges.txt")


def convert_qwen_v1_to_hf(src: Path, dst: Path) -> None:
    """Write a Qwen v1 folder in Qwen2 transformers format (also what TensorRT-LLM's Qwen2 path reads).

    Qwen2 has no logn scaling or dynamic NTK, so the result matches Qwen v1 within `seq_length`.
    Tokenizer files are copied as they are.
    """
    src = Path(src)
    config = read_config(src)
    if config.family != QWEN_V1.model_type:
        raise UserError(f"{src} is not a Qwen v1 checkpoint (model_type {config.family!r})")
    sd = to_internal(config, read_tensors(src), QWEN_V1.layout)
    with atomic_folder(dst) as tmp:
        write_checkpoint_files(tmp, config, sd, "hf")
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.llm.weights.checkpoint QWEN_V1_FOLDER OUT_FOLDER`: the Qwen2-format copy that
    `trtllm-serve`, vLLM and transformers read (the README's multi-GPU recipe)."""
    import argparse

    p = argparse.ArgumentParser(description="Write a Qwen v1 checkpoint in the Qwen2 transformers format.")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    args = p.parse_args(argv)
    try:
        convert_qwen_v1_to_hf(args.src, args.dst)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
