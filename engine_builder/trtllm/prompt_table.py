"""Image features as TensorRT-LLM prompt-table rows (its p-tuning / multimodal convention).

A prompt's slots (MiniGPT-4's 32 query positions per image) go into the engine as token ids past
the model's vocabulary: id `vocab_size + r` reads row r of the request's prompt embedding table
instead of the embedding matrix. `vocab_size` is the embedding matrix's row count (the model
config's), which TensorRT-LLM compares ids against; a tokenizer often has fewer ids (Qwen-7B: 151,851
of 151,936 rows; the demo LLaMA: 898 of 960), and ids between the two would read padding rows. Each distinct slot content (an image, by its key) gets its rows once, in order
of first appearance; a slot showing an image again reuses its rows. `extra_ids` mark which image a
position shows (0 for ordinary tokens), so the KV cache's block reuse never mistakes one image's
rows for another's that happen to have the same ids.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from torch import Tensor

from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.text.prompt import Prompt


@dataclasses.dataclass(frozen=True)
class PromptTableInput:
    ids: list[int]  # the prompt's ids; those >= vocab_size address table rows
    table: Tensor | None  # [rows, hidden] in the engine's dtype, None for a prompt without slots
    extra_ids: list[int] | None  # per position: the image it shows (a 63-bit hash of its key), 0 elsewhere


def content_id(key: str) -> int:
    """A stable non-zero 63-bit id for a slot's content key."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1 | 1


def prompt_table_input(prompt: Prompt, config: DecoderConfig, dtype: torch.dtype) -> PromptTableInput:
    """The executor's inputs for `prompt` on a model of `config` (its embedding's `vocab_size`)."""
    vocab_size = config.vocab_size
    if not prompt.slots:
        return PromptTableInput(list(prompt.ids), None, None)
    ids, extra = list(prompt.ids), [0] * len(prompt.ids)
    first_row: dict[str, int] = {}
    rows: list[Tensor] = []
    for (start, length), embeds, key in zip(prompt.slots, prompt.embeds, prompt.keys):
        if key not in first_row:
            first_row[key] = sum(r.shape[0] for r in rows)
            rows.append(embeds)
        ids[start:start + length] = range(vocab_size + first_row[key], vocab_size + first_row[key] + length)
        extra[start:start + length] = [content_id(key)] * length
    return PromptTableInput(ids, torch.cat(rows).to(dtype), extra)
