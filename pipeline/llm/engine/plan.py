"""One engine step's plan, as plain data (vLLM v1's request and scheduler-output types): a request inside the
engine, what it feeds in a step (`Scheduled`), and the step (`StepPlan`). The scheduler makes plans; the runner,
the sampler and `Outputs.settle` read them."""

from __future__ import annotations

import dataclasses

from torch import Tensor

from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.engine.sampling import Draws
from pipeline.llm.engine.seam import TokenStream
from pipeline.llm.text.grammar import Grammar
from pipeline.llm.text.prompt import Prompt


@dataclasses.dataclass(eq=False)
class Request:
    """A request inside the engine: what was asked, where it runs, and its next input."""

    prompt: Prompt
    params: SamplingParams
    stop_ids: set[int]
    session: str | None
    stream: TokenStream
    draws: Draws
    submitted: float
    grammar: Grammar | None = None  # the tokens it may draw (structured output)
    bias: Tensor | None = None  # its logit_bias as one row over the vocabulary, on the device (made at its start)
    sig: list = dataclasses.field(default_factory=list)  # its prompt's signature (set when it is placed)
    row: int = -1
    position: int = 0  # where the next fed token (while reading its prompt: the next chunk) goes in the cache
    table: int = 0  # rotary table (Qwen v1 dynamic NTK)
    last_token: int = 0
    first_token_at: float = 0.0


@dataclasses.dataclass(frozen=True, eq=False)
class Scheduled:
    """One request's part of a step: `size` tokens fed from cache position `start` on. A running request feeds
    its last token and the tokens `proposed` to follow it, and keeps the proposed ones up to the first the model
    would not have drawn. `chained`: it runs after the step in flight, unsettled, whose last kept token it feeds
    and whose kept count moves its positions, both on the device (`start` then assumes that step keeps all it
    proposed: the host learns what it kept as it settles it). A request reading its prompt feeds a chunk of it,
    whose last position is drawn where the chunk ends the prompt (`last`)."""

    request: Request
    start: int
    size: int
    proposed: tuple[int, ...] = ()
    chained: bool = False
    last: bool = False
    width: int = 1  # a running request's tokens fed, padded to the step's width (one the runner has graphs for)

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """One engine step as data (vLLM v1's scheduler output): the running requests, in cache rows 0..n-1, each
    feeding its last token and those proposed after it, and the prompt chunks read beside them, all under one
    token budget.
    Every running request's positions and every prompt's last position are drawn (`drawing`), in one draw."""

    rows: tuple[Scheduled, ...]
    chunks: tuple[Scheduled, ...]

    @property
    def drawing(self) -> tuple[Scheduled, ...]:
        return self.rows + tuple(c for c in self.chunks if c.last)

    @property
    def verifies(self) -> bool:
        """Some row feeds proposed tokens: the step checks them."""
        return any(s.proposed for s in self.rows)
