"""Sources into the prompt, numbered, and citations out of the reply: the model is asked to cite sources as [1],
[2]; a citation of a number that was not given (a model's invention) is taken out of the reply, never shown as a
source, and the sources shown are those cited, in the order first cited.
"""

from __future__ import annotations

import re

from pipeline.docs.retrieval import Source

CITATION = re.compile(r"(\s*)\[(\d+(?:\s*,\s*\d+)*)\]")  # with the space before it, which goes with it
INSTRUCTION = ("Answer the question from the numbered sources below, citing each source you use as [1], [2] right "
               "after the sentence it supports. If the sources do not answer it, say so.")


def sources_prompt(question: str, sources: list[Source]) -> str:
    """The user turn that carries `sources` and `question`."""
    blocks = "\n\n".join(f"[{s.number}] {s.where}\n{s.text}" for s in sources)
    return f"{INSTRUCTION}\n\nSources:\n\n{blocks}\n\nQuestion: {question}"


def cited(reply: str, sources: list[Source]) -> tuple[str, list[Source]]:
    """(the reply with citations of numbers not given removed, the sources it cites in order of first citation)."""
    given = {s.number: s for s in sources}
    order: list[int] = []

    def keep(match: re.Match) -> str:
        numbers = [int(n) for n in re.split(r"\s*,\s*", match[2])]
        valid = [n for n in numbers if n in given]
        order.extend(n for n in valid if n not in order)
        return match[1] + "[" + ", ".join(map(str, valid)) + "]" if valid else ""

    return CITATION.sub(keep, reply), [given[n] for n in order]
