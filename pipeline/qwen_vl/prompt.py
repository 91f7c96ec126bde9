"""Where a picture goes in a Qwen2.5-VL prompt, and every token's M-RoPE position.

The chat template writes a picture as `<|vision_start|><|image_pad|><|vision_end|>`; the processor
grows the one `<|image_pad|>` into one per merged patch (`preprocess.llm_tokens`), a slot the decoder
reads the picture's embeddings from. Positions: text tokens count on by one; a picture's tokens sit on
its grid of merged patches — time, row and column each counted from the position it starts at — and
the text after it goes on from that start plus the grid's longer side (transformers' `get_rope_index`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.errors import UserError
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.text.tokenizer import Tokenizer

IMAGE_PAD = "<|image_pad|>"
TURN_END = "<|im_end|>"


def image_prompt(tokenizer: Tokenizer, tokens: int) -> Prompt:
    """The ids one `<|image_pad|>` grows into: `tokens` of them, one slot."""
    pad = tokenizer.special_id(IMAGE_PAD)
    if pad is None:
        raise UserError(f"the tokenizer has no {IMAGE_PAD} token: it is not Qwen2.5-VL's")
    return Prompt((pad,) * tokens, ((0, tokens),))


def rope_positions(prompt: Prompt, grids: list[tuple[int, int, int]]) -> Tensor:
    """M-RoPE positions [3, len] (time, row, column) of `prompt`, its slots holding pictures whose merged
    grids are `grids` (t, h, w), in order."""
    if len(grids) != len(prompt.slots):
        raise ValueError(f"{len(prompt.slots)} picture slots but {len(grids)} grids")
    pieces, at, position = [], 0, 0
    for (start, length), (t, h, w) in zip(prompt.slots, grids):
        if length != t * h * w:
            raise ValueError(f"a slot of {length} tokens cannot hold a {t}×{h}×{w} grid")
        pieces.append(torch.arange(position, position + start - at).expand(3, -1))
        position += start - at
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        pieces.append(grid.reshape(3, -1) + position)
        position += max(h, w)
        at = start + length
    pieces.append(torch.arange(position, position + len(prompt.ids) - at).expand(3, -1))
    return torch.cat(pieces, dim=1)
