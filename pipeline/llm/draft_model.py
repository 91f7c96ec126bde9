"""Drafts from a small model that shares the target's tokenizer (Qwen2.5-0.5B-Instruct for Qwen2.5-7B,
SmolLM2-135M for a larger SmolLM2): its greedy continuation of the conversation so far.

The small model runs in an engine of its own (`LLMEngine`: its cache rows, CUDA graphs, chunked
prefill, its own thread), so a draft costs the small model's decode steps and no more. A step's drafts are
asked for all its rows at once (`propose`): every request goes to the draft engine before any is read, so the
draft engine decodes them as one batch. Each request drafts under a session of its own, and the draft engine
finds the request's earlier text in its rows by content, so it reads only the tokens that are new since
that request's last draft. A greedy draft proposes each token for certain; the verify step's rule for such
drafts (`Sampler.draw`) keeps the target's own distribution.

Drafts are asked a step ahead: as a step's drafts are handed out, the small model starts on the next step's,
as if the step keeps its whole draft (`_Ahead`), and works while the target checks this one. Where the text
the next step is asked after continues as that work assumed, the draft is that work's; else it is dropped
and the draft is asked again. Which tokens are drafted follows from the text alone.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.engine.seam import LLMEngine, TokenStream
from pipeline.llm.engine.speculation import Ask
from pipeline.llm.text.prompt import Prompt


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """A request's next draft, asked while a step checks a draft: the small model's continuation of `text` (the
    request's text and that draft; one token more than a draft: the step's own drawn token)."""

    text: tuple
    stream: TokenStream


class DraftModel:
    """A drafter (see `speculation.Drafter`) over a small model's engine; `name` says which. `reused`: drafts
    taken from the work asked a step ahead."""

    always = True  # it always has a draft: no cheap look ahead decides whether reading the step in flight pays

    def __init__(self, engine: LLMEngine, name: str):
        self.engine, self.name = engine, name
        self._sessions = itertools.count()
        self._ahead: dict[str, _Ahead] = {}  # by request (its session)
        self.reused = 0

    def index(self) -> str:
        """A request's state: the session its drafts run under in the draft engine."""
        return f"draft-{next(self._sessions)}"

    def propose(self, asks: Sequence[Ask]) -> list[list[int]]:
        """The small model's k most likely next tokens, one after another, after each ask's text (from the
        work asked a step ahead where that still continues the text); none where the text holds an image's
        slots (the small model cannot read them) or outgrows its context. Then each next draft is asked."""
        texts = [(*a.history, *a.last) for a in asks]
        ahead = [self._take(a, text) for a, text in zip(asks, texts)]
        fresh = [self._submit(a.state, text, a.k) if got is None else None for a, text, got in zip(asks, texts, ahead)]
        drafts = [got if got is not None else list(s) if s is not None else [] for got, s in zip(ahead, fresh)]
        for a, text, draft in zip(asks, texts, drafts):
            if draft and (stream := self._submit(a.state, (*text, *draft), a.k + 1)) is not None:
                self._ahead[a.state] = _Ahead((*text, *draft), stream)
        return drafts

    def _take(self, ask: Ask, text: tuple) -> list[int] | None:
        """`ask`'s draft from the work asked a step ahead: where `text` is that work's text followed by the small
        model's first tokens (a step that kept its whole draft, and drew what the small model put next, where
        the step was settled); None where there is none such (it is let go of)."""
        ahead = self._ahead.pop(ask.state, None)
        if ahead is None:
            return None
        known = len(ahead.text)
        if text[:known] == ahead.text:
            tokens, new = list(ahead.stream), list(text[known:])
            if tokens[:len(new)] == new and len(tokens) > len(new):
                self.reused += 1
                return tokens[len(new):len(new) + ask.k]
        ahead.stream.cancel()
        return None

    def _submit(self, session: str, ids: tuple, k: int) -> TokenStream | None:
        """The small model's greedy k tokens after `ids`, under `session`; None where it cannot read them."""
        if not k or not all(isinstance(t, int) for t in ids) or len(ids) + k >= self.engine.context:
            return None
        return self.engine.submit(Prompt(ids), SamplingParams(max_new_tokens=k, temperature=0, repetition_penalty=1.0),
                                  set(), session=session)

    def forget(self, state: str) -> None:
        """The request ended: its draft asked ahead, if any, is let go of."""
        if (ahead := self._ahead.pop(state, None)) is not None:
            ahead.stream.cancel()

    def close(self) -> None:
        self.engine.close()
