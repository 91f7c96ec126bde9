"""Drafts from a small model that shares the target's tokenizer (Qwen2.5-0.5B-Instruct for Qwen2.5-7B,
SmolLM2-135M for a larger SmolLM2): its greedy continuation of the conversation so far.

The small model runs in an engine of its own (`LLMEngine`: its cache rows, CUDA graphs, chunked
prefill), so a draft costs the small model's decode steps and no more: each request asks under a session
of its own, and the draft engine finds the request's earlier text in its rows by content, so it reads
only the tokens that are new since that request's last draft (the kept ones and the one after them).
A greedy draft proposes each token for certain; the verify step's rule for such drafts
(`Sampler.verify_draw`) keeps the target's own distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.llm.engine.sampling import SamplingParams
from pipeline.llm.engine.seam import LLMEngine
from pipeline.llm.text.prompt import Prompt


class DraftModel:
    """A drafter (see `speculation.PromptLookup`) over a small model's engine; `name` says which."""

    always = True  # it always has a draft: no cheap look ahead decides whether reading the step in flight pays

    def __init__(self, engine: LLMEngine, name: str):
        self.engine, self.name = engine, name

    def index(self) -> ModelDrafts:
        return ModelDrafts(self.engine)

    def close(self) -> None:
        self.engine.close()


class ModelDrafts:
    """One request's drafts from the small model."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.session = engine, f"draft-{id(self)}"

    def propose(self, history: Sequence, k: int, last: Sequence = ()) -> list[int]:
        """The small model's `k` most likely next tokens, one after another, after `history` + `last`; none
        where the text holds an image's slots (the small model cannot read them) or outgrows its context."""
        ids = (*history, *last)
        if not k or not all(isinstance(t, int) for t in ids) or len(ids) + k >= self.engine.context:
            return []
        return list(self.engine.submit(Prompt(ids), SamplingParams(max_new_tokens=k, temperature=0,
                                                                   repetition_penalty=1.0), set(),
                                       session=self.session))
