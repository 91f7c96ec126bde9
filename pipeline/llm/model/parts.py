"""The parts of one engine step, as the decoder reads them: `Rows` (decode and verify), prompt `Tokens` (on a GPU)
and a `Prefill` (a prompt read with SDPA: on the CPU, or a picture's), each placed in the step's flat token list
(`spans_of`)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from plugins.decode_attention import TILE_ROWS


@dataclasses.dataclass(frozen=True)
class Rows:
    """`per_row` tokens for each cache row 0..B-1, row b's at positions starts[b].. with rotary offset
    offsets[b] (`RotaryTables.offset`): one for a decode step, the last token and the tokens proposed after
    it for a verify step (a decode step is a verify step of none). Each query attends in
    place to its row up to its own position (the decode attention), reading at most the first `kv_len`
    positions; a row whose `live` is 0 (a padding row of a graph's bucket) reads nothing."""

    starts: Tensor
    offsets: Tensor
    kv_len: int
    per_row: int = 1
    live: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Prefill:
    """A prompt's tokens at positions start.. of cache row `row` (`size` of them; 0: all the step's
    tokens left), read eagerly: its keys are read exactly up to its end, causal attention aligned to
    the last key (plain causal attention for a fresh prompt, which skips the masked half). Rotary: each
    token at `offset` + its position, or, given, at its own M-RoPE positions `rope` [3, size]."""

    row: int
    start: int
    offset: int = 0
    size: int = 0
    rope: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Prompt tokens, of one request or several, each with its own place (tensors [size]): token i goes to
    cache row `rows[i]` at `positions[i]` with rotary offset `offsets[i]` and attends to the row's first
    `lengths[i]` positions (its position + 1; 0 for a padding token, which reads nothing and writes a scratch
    position). Laid out in runs of `tile_queries` tokens of one row each (the attention scores a run
    together), reading at most `kv_len` positions. Its shapes do not depend on which prompts it holds, so one
    CUDA graph serves every step of so many tokens. `tile_rows`: the head rows the attention scores at once
    (`plugins.decode_attention`; more for one long chunk alone, which needs no runs)."""

    rows: Tensor
    positions: Tensor
    offsets: Tensor
    lengths: Tensor
    kv_len: int
    tile_rows: int = TILE_ROWS

    @property
    def size(self) -> int:
        return self.rows.shape[0]


Part = Rows | Prefill | Tokens
ALL = slice(None)  # `Decoder.forward`'s outputs: logits at every position


@dataclasses.dataclass(frozen=True)
class Span:
    """A part's place in the step's flat token list, its tokens' positions in the cache and rows of the
    rotary tables [size], and (rows and prompt tokens) how many positions each token's query reads: made
    once a step, not in every layer (two launches a layer, 67 µs of a 7B decode step on an H200)."""

    part: Part
    begin: int
    end: int
    positions: Tensor
    rotary: Tensor
    lengths: Tensor | None = None


def spans_of(parts: tuple[Part, ...], total: int, device: torch.device) -> list[Span]:
    spans, begin = [], 0
    for part in parts:
        lengths = None
        if isinstance(part, Rows):
            size = part.starts.shape[0] * part.per_row
            positions = (part.starts[:, None] + torch.arange(part.per_row, device=device)).flatten()
            offsets = part.offsets[:, None].expand(-1, part.per_row).flatten()
            lengths = positions + 1  # each query up to its own position
            if part.live is not None:  # padding rows read nothing (their scratch position is past the context)
                lengths = lengths * part.live[:, None].expand(-1, part.per_row).flatten()
        elif isinstance(part, Tokens):
            size, positions, offsets, lengths = part.size, part.positions, part.offsets, part.lengths
        else:
            size = part.size or total - begin
            positions = part.start + torch.arange(size, device=device)
            offsets = part.offset
        spans.append(Span(part, begin, begin + size, positions, positions + offsets, lengths))
        begin += size
    assert begin == total, f"the parts cover {begin} tokens of {total}"
    return spans
