"""Where an image's embeddings go in a SmolVLM prompt: each `<image>` token grows into its tiles' runs.

Idefics3's processor writes an image as, for a rows × cols grid (then the global view):
    <fake_token_around_image><row_1_col_1><image>×n … <fake_token_around_image><row_1_col_C><image>×n \n
    … (one line per row) …
    \n<fake_token_around_image><global-img><image>×n<fake_token_around_image>
and, for a single tile, only the last line without its leading newline; n is `image_seq_len`
(`VisionConfig.tokens_per_image`). The markers are special tokens, so the text between them (the
newlines) is tokenized on its own; building the ids piece by piece gives exactly the ids the
processor's tokenizer gives the expanded text, and user text never turns into markers. Each run of
`<image>` tokens is a slot the decoder reads one tile's embeddings from, in the tiles' order.
"""

from __future__ import annotations

from typing import Protocol

from pipeline.errors import UserError
from pipeline.llm.text.prompt import Prompt

FAKE = "<fake_token_around_image>"
IMAGE = "<image>"
GLOBAL = "<global-img>"


def row_col(row: int, col: int) -> str:
    """The marker of the tile at (row, col), both counted from 1."""
    return f"<row_{row}_col_{col}>"


class TextTokenizer(Protocol):
    """What this needs of a tokenizer (`pipeline.llm.text.tokenizer.Tokenizer` has it)."""

    def encode(self, text: str) -> list[int]: ...

    def special_id(self, token: str) -> int | None: ...


def image_text(rows: int, cols: int, seq_len: int) -> str:
    """The processor's expansion of one `<image>` as text."""
    run = IMAGE * seq_len
    global_view = f"{FAKE}{GLOBAL}{run}{FAKE}"
    if rows == 0 and cols == 0:
        return global_view
    grid = "".join("".join(f"{FAKE}{row_col(r, c)}{run}" for c in range(1, cols + 1)) + "\n"
                   for r in range(1, rows + 1))
    return f"{grid}\n{global_view}"


def _special(tokenizer: TextTokenizer, token: str) -> int:
    found = tokenizer.special_id(token)
    if found is None:
        raise UserError(f"the tokenizer has no {token} token: it is not a SmolVLM (Idefics3) tokenizer")
    return found


def image_ids(tokenizer: TextTokenizer, rows: int, cols: int, seq_len: int) -> Prompt:
    """`image_text`'s token ids, built marker by marker, and where each tile's slot is."""
    ids: list[int] = []
    slots: list[tuple[int, int]] = []
    fake, image = _special(tokenizer, FAKE), _special(tokenizer, IMAGE)

    def tile(marker: str) -> None:
        ids.extend([fake, _special(tokenizer, marker)])
        slots.append((len(ids), seq_len))
        ids.extend([image] * seq_len)

    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            tile(row_col(r, c))
        if r < rows:
            ids.extend(tokenizer.encode("\n"))
    if rows or cols:
        ids.extend(tokenizer.encode("\n\n"))  # the last row's newline and the global view's, one text run
    tile(GLOBAL)
    ids.append(fake)
    return Prompt(tuple(ids), tuple(slots))
