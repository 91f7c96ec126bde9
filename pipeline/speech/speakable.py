"""What of a reply is read aloud, and when: a reply is Markdown, and its code blocks, tables, formulas and links
read out symbol by symbol help no one. Each becomes a few words (a code block: "(code shown on screen)"); emphasis,
heading and list marks and citation numbers go; a link is read as its text.

`SpeechQueue` gives a reply's sentences as they complete while it streams, so speech starts with the first
sentence, not after the last: a sentence is complete once the text after it has begun (or the reply has ended),
and never while a code block, a formula or a table row is still open.
"""

from __future__ import annotations

import re

FENCE = re.compile(r"^ {0,3}(```|~~~).*?(^ {0,3}\1[^\n]*$|\Z)", re.MULTILINE | re.DOTALL)
DISPLAY_MATH = re.compile(r"\$\$.*?(\$\$|\Z)|\\\[.*?(\\\]|\Z)", re.DOTALL)
INLINE_MATH = re.compile(r"(?<![\\$])\$(?=\S)[^$\n]+?(?<=\S)\$(?!\d)|\\\(.*?\\\)")
TABLE = re.compile(r"(^ *\|.*\|? *$\n?)+", re.MULTILINE)
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
URL = re.compile(r"<?https?://[^\s>)]+>?")
CITATION = re.compile(r"\s*\[\d+(?:\s*,\s*\d+)*\]")
MARKS = re.compile(r"^ {0,3}(#{1,6} +|> ?|[-*+] +|\d+[.)] +)|[*_~`]+", re.MULTILINE)
SENTENCE_END = re.compile(r"[.!?…](?=[\"')\]]*\s)|\n")  # a line ends one too (a heading, a list item)
CODE_WORDS, TABLE_WORDS, MATH_WORDS, LINK_WORDS = ("(code shown on screen)", "(a table shown on screen)",
                                                   "(a formula)", "(a link)")


def speakable(markdown: str) -> str:
    """`markdown` as words to read aloud."""
    text = FENCE.sub(f"\n\n{CODE_WORDS}\n\n", markdown)
    text = DISPLAY_MATH.sub(f" {MATH_WORDS} ", text)
    text = TABLE.sub(f"\n{TABLE_WORDS}\n\n", text)
    text = INLINE_MATH.sub(f" {MATH_WORDS} ", text)
    text = LINK.sub(lambda m: m.group(1) or LINK_WORDS, text)
    text = URL.sub(LINK_WORDS, text)
    text = CITATION.sub("", text)
    text = MARKS.sub("", text)
    return re.sub(r"[ \t]+", " ", text).strip()


def sentences(text: str) -> list[str]:
    """`text` cut into sentences (a line's end ends one too), each stripped, the empty ones left out."""
    out, start = [], 0
    for end in SENTENCE_END.finditer(text):
        out.append(text[start:end.end()])
        start = end.end()
    out.append(text[start:])
    return [s for s in (" ".join(part.split()) for part in out) if s]


def _blocks(text: str) -> list[tuple[int, int, bool]]:
    """(start, end, closed) of each code block and display formula in `text`."""
    found = [(m.start(), m.end(), bool(m.group(2))) for m in FENCE.finditer(text)]
    return found + [(m.start(), m.end(), bool(m.group(1) or m.group(2))) for m in DISPLAY_MATH.finditer(text)]


class SpeechQueue:
    """A streaming reply's sentences to speak, each given once, as soon as it is complete."""

    def __init__(self):
        self._spoken = 0  # characters of the reply already given

    def ready(self, reply: str, final: bool = False) -> list[str]:
        """The sentences of `reply` (the whole reply so far) completed since the last call; `final`: the reply has
        ended, so the rest is complete."""
        end = len(reply) if final else self._complete(reply)
        if end <= self._spoken:
            return []
        piece, self._spoken = reply[self._spoken:end], end
        return sentences(speakable(piece))

    def _complete(self, reply: str) -> int:
        """Where the complete sentences of `reply` end: after the last sentence end outside a code block or formula
        (a closed block ends one; the text before an open one is complete), and before a table row still open."""
        blocks = _blocks(reply)
        ends = [m.end() for m in SENTENCE_END.finditer(reply, self._spoken)
                if not any(start <= m.start() < stop for start, stop, _ in blocks)]
        ends += [stop if closed else start for start, stop, closed in blocks]
        last_line = reply.rfind("\n") + 1
        if reply[last_line:].lstrip().startswith("|"):  # a table row being written
            ends = [e for e in ends if e <= last_line]
        return max([self._spoken, *ends])
