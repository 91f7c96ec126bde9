"""Drafts from a small model that shares the target's tokenizer (Qwen2.5-0.5B-Instruct for Qwen2.5-7B,
SmolLM2-135M for a larger SmolLM2): its greedy continuation of the conversation so far.

The small model runs in an engine of its own (`LLMEngine`: its cache rows, CUDA graphs, chunked
prefill), so a draft costs the small model's decode steps and no more. A step's drafts are asked for all
its rows at once (`propose`): every request goes to the draft engine before any is read, so the draft
engine decodes them as one batch. Each request drafts under a session of its own, and the draft engine
finds the request's earlier text in its rows by content, so it reads only the tokens that are new since
that request's last draft (the kept ones and the one after them). A greedy draft proposes each token for
certain; the verify step's rule for such drafts (`Sampler.draw`) keeps the target's own distribution.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.engine.seam import LLMEngine
from pipeline.llm.engine.speculation import Ask
from pipeline.llm.text.prompt import Prompt


class DraftModel:
    """A drafter (see `speculation.Drafter`) over a small model's engine; `name` says which."""

    always = True  # it always has a draft: no cheap look ahead decides whether reading the step in flight pays

    def __init__(self, engine: LLMEngine, name: str):
        self.engine, self.name = engine, name
        self._sessions = itertools.count()

    def index(self) -> str:
        """A request's state: the session its drafts run under in the draft engine."""
        return f"draft-{next(self._sessions)}"

    def propose(self, asks: Sequence[Ask]) -> list[list[int]]:
        """The small model's k most likely next tokens, one after another, after each ask's text; none where
        the text holds an image's slots (the small model cannot read them) or outgrows its context."""
        params = [SamplingParams(max_new_tokens=a.k, temperature=0, repetition_penalty=1.0) for a in asks]
        streams = []
        for a, p in zip(asks, params):
            ids = (*a.history, *a.last)
            fits = a.k and all(isinstance(t, int) for t in ids) and len(ids) + a.k < self.engine.context
            streams.append(self.engine.submit(Prompt(ids), p, set(), session=a.state) if fits else None)
        return [list(s) if s is not None else [] for s in streams]

    def close(self) -> None:
        self.engine.close()
