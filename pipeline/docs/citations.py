"""Sources into the prompt, numbered, and citations out of the reply: the model is asked to cite sources as [1],
[2]; a citation of a number that was not given (a model's invention) is taken out of the reply, never shown as a
source, and the sources shown are those cited, in the order first cited.
"""

from __future__ import annotations

import re

from pipeline.docs.retrieval import Source

CITATION = re.compile(r"(\s*)\[(\d+(?:\s*,\s*\d+)*)\]")  # with the space before it, which goes with it
MAYBE_CITATION = re.compile(r"\s*(\[[\d\s,]*)?$")  # the end of a text that may still become one
INSTRUCTION = ("Answer the question from the numbered sources below, citing each source you use as [1], [2] right "
               "after the sentence it supports. If the sources do not answer it, say so.")


def sources_prompt(question: str, sources: list[Source]) -> str:
    """The user turn that carries `sources` and `question`."""
    blocks = "\n\n".join(f"[{s.number}] {s.where}\n{s.text}" for s in sources) or "(none found)"
    return f"{INSTRUCTION}\n\nSources:\n\n{blocks}\n\nQuestion: {question}"


class CitationStream:
    """A reply's text as it streams, citations of numbers not given taken out before any of it is shown: a piece
    that may still become a citation ("… [1", or trailing spaces) is held until the next piece says."""

    def __init__(self, sources: list[Source]):
        self.given = {s.number: s for s in sources}
        self.order: list[int] = []
        self.held = ""

    def push(self, text: str) -> str:
        """The part of the reply so far that can be shown now, citations checked."""
        self.held += text
        cut = MAYBE_CITATION.search(self.held).start()
        shown, self.held = self.held[:cut], self.held[cut:]
        return CITATION.sub(self._keep, shown)

    def finish(self) -> str:
        """The rest, at the reply's end."""
        shown, self.held = self.held, ""
        return CITATION.sub(self._keep, shown)

    @property
    def cited(self) -> list[Source]:
        """The sources cited so far, in the order first cited."""
        return [self.given[n] for n in self.order]

    def _keep(self, match: re.Match) -> str:
        numbers = [int(n) for n in re.split(r"\s*,\s*", match[2])]
        valid = [n for n in numbers if n in self.given]
        self.order.extend(n for n in dict.fromkeys(valid) if n not in self.order)
        return match[1] + "[" + ", ".join(map(str, valid)) + "]" if valid else ""


def cited(reply: str, sources: list[Source]) -> tuple[str, list[Source]]:
    """(the reply with citations of numbers not given removed, the sources it cites in order of first citation)."""
    stream = CitationStream(sources)
    return stream.push(reply) + stream.finish(), stream.cited
