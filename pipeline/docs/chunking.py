"""A document's sections → passages sized for the embedder: split along the text's own structure (a section never
shares a passage with another; inside it paragraphs, then sentences, then words), each passage at most
`max_tokens` of the embedder's tokens, the next one starting with the last `overlap` tokens' worth of units of the
one before, so that a fact cut at a boundary is whole in one of them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

from pipeline.docs.readers import Document, Section

PARAGRAPH = re.compile(r"\n\s*\n")
SENTENCE = re.compile(r"(?<=[.!?。])\s+")
WORD = re.compile(r"\s+")


@dataclasses.dataclass(frozen=True)
class Passage:
    """A passage's text and where it is: its page and heading, its characters [start, end) in `Document.text`."""

    text: str
    start: int
    end: int
    page: int | None
    heading: str | None


def passages(document: Document, count: Callable[[str], int], max_tokens: int, overlap: int) -> list[Passage]:
    """Every section's passages, in order; `count(text)` the embedder's tokens of a text."""
    return [p for section in document.sections for p in _section_passages(section, count, max_tokens, overlap)]


def _units(text: str, start: int, count: Callable[[str], int], limit: int,
           levels: tuple[re.Pattern, ...] = (PARAGRAPH, SENTENCE, WORD)) -> Iterator[tuple[int, int, int]]:
    """(start, end, tokens) of the pieces of `text` (at `start` in its section) to pack: paragraphs, one over
    `limit` tokens cut into sentences, a sentence over it into words (a word over it stays whole)."""
    at = 0
    for match in [*levels[0].finditer(text), None]:
        end = match.start() if match else len(text)
        if end > at:
            tokens = count(text[at:end])
            if tokens <= limit or len(levels) == 1:
                yield start + at, start + end, tokens
            else:
                yield from _units(text[at:end], start + at, count, limit, levels[1:])
        at = match.end() if match else at
    return


def _section_passages(section: Section, count: Callable[[str], int], max_tokens: int,
                      overlap: int) -> list[Passage]:
    text, base = section.text, section.start
    units = list(_units(text, 0, count, max_tokens))
    out: list[Passage] = []
    i = 0
    while i < len(units):
        j, tokens = i, 0
        while j < len(units) and (j == i or tokens + units[j][2] <= max_tokens):
            tokens += units[j][2]
            j += 1
        a, b = units[i][0], units[j - 1][1]
        out.append(Passage(text[a:b], base + a, base + b, section.page, section.heading))
        if j >= len(units):
            break
        back, carried = j, 0  # the next passage starts with the last units worth `overlap` tokens, if any fit
        while back - 1 > i and carried + units[back - 1][2] <= overlap:
            back -= 1
            carried += units[back][2]
        i = back
    return out
