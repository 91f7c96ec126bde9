"""One engine step's plan, as plain data (vLLM v1's request and scheduler-output types): a request inside the
engine, what it feeds in a step (`Scheduled`), and the step (`StepPlan`). The scheduler makes plans; the runner,
the sampler and `Outputs.settle` read them."""

from __future__ import annotations

import dataclasses

from torch import Tensor

from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.engine.sampling import Draws
from pipeline.llm.engine.seam import TokenStream
from pipeline.llm.engine.speculation import DraftState
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
    draft: DraftState | None = None  # its speculative drafting, where the engine speculates


@dataclasses.dataclass(frozen=True, eq=False)
class Scheduled:
    """One request's part of a step: `size` tokens fed from cache position `start` on. A running request feeds
    its last token and the tokens `draft`ed after it (`chained`: the last token is the one the step before drew,
    still on the device); a request reading its prompt feeds a chunk of it, whose last position is drawn where
    the chunk ends the prompt (`last`)."""

    request: Request
    start: int
    size: int
    draft: tuple[int, ...] = ()
    chained: bool = False
    last: bool = False
    width: int = 1  # a running request's tokens fed, its draft padded to a draft size (the step's widest)

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """One engine step as data (vLLM v1's scheduler output): the running requests, in cache rows 0..n-1, each
    feeding its last token and its draft, and the prompt chunks read beside them, all under one token budget.
    Every running request's positions and every prompt's last position are drawn (`drawing`), in one draw."""

    rows: tuple[Scheduled, ...]
    chunks: tuple[Scheduled, ...]

    @property
    def drawing(self) -> tuple[Scheduled, ...]:
        return self.rows + tuple(c for c in self.chunks if c.last)

    @property
    def drafted(self) -> bool:
        return any(s.draft for s in self.rows)
