"""Sampling parameters, checked once where they are made, with messages a user can act on.

Torch-free, like the rest of the engine's contract (`seam.py`): the HTTP client of `--llm-endpoint` and every
front end make these without importing torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path

from pipeline.errors import UserError


@dataclasses.dataclass(frozen=True)
class Limit:
    """The values a sampling setting takes: every front end checks through these, and the UI's sliders
    span them."""

    low: float
    high: float
    whole: bool = False  # a whole number (integral floats, as sliders and JSON send them, count)
    low_open: bool = False  # `low` itself is not allowed

    def describe(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        return f"{kind} from {self.low} to {self.high}" + (f" (not {self.low})" if self.low_open else "")

    def check(self, name: str, value) -> int | float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and (value > self.low if self.low_open else value >= self.low) and value <= self.high \
            and (not self.whole or value == int(value))
        if not ok:
            raise InvalidSampling(name, f"{name} must be {self.describe()}, got {value!r}")
        return int(value) if self.whole else float(value)


class InvalidSampling(UserError):
    """A sampling value out of its `LIMITS`; `param` names it (the OpenAI API reports it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message, param)


LIMITS = {
    "max_new_tokens": Limit(1, 32768, whole=True),
    "temperature": Limit(0, 2),
    "top_p": Limit(0, 1, low_open=True),
    "top_k": Limit(0, 1000, whole=True),
    "repetition_penalty": Limit(0.5, 3),
    "presence_penalty": Limit(-2, 2),
    "frequency_penalty": Limit(-2, 2),
    "seed": Limit(0, 2**63 - 1, whole=True),
    "logprobs": Limit(0, 20, whole=True),
}
OPTIONAL = ("seed", "logprobs")  # None is a value of these: random, and no log-probabilities


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off; seed None is random."""

    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    repetition_penalty: float = 1.05
    presence_penalty: float = 0.0  # OpenAI's: minus this from each token the reply has used
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often the reply has used it
    seed: int | None = None
    logprobs: int | None = None  # each token's log-probability and this many most likely alternatives
    stop: tuple[str, ...] = ()  # the reply ends before the first of these strings (an API client's `stop`)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100) added to its logit before sampling

    def __post_init__(self) -> None:
        """Checked where it is made, so a `SamplingParams` that exists is valid and nothing downstream checks
        again; values are kept in their plain form (whole numbers as int, a stop list as a tuple)."""
        for name, limit in LIMITS.items():
            value = getattr(self, name)
            if value is not None or name not in OPTIONAL:
                object.__setattr__(self, name, limit.check(name, value))
        for name, check in LISTS.items():
            object.__setattr__(self, name, check(name, getattr(self, name)))

    @classmethod
    def from_values(cls, **values) -> "SamplingParams":
        """Every front end's sampling values, by name (values of None keep the default, a seed of -1 is
        random): the same out-of-range value gets the same message from the UI, the API and the terminal chat."""
        if values.get("seed") == -1:  # the UI's "random" (its seed box shows -1)
            values = {**values, "seed": None}
        unknown = set(values) - set(LIMITS) - set(LISTS)
        if unknown:
            raise UserError(f"unknown sampling setting {sorted(unknown)[0]!r}: use one of "
                            f"{', '.join([*LIMITS, *LISTS])}")
        return cls(**{name: value for name, value in values.items() if value is not None})


# What a value an API request leaves out is, where the model names none: the one that changes nothing (as in
# vLLM), so `temperature: 0` alone is the model's greedy reply. The UI keeps `SamplingParams`' own defaults.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


def checkpoint_defaults(folder: Path) -> dict[str, float]:
    """The sampling values (of `NEUTRAL`'s) a checkpoint's `generation_config.json` names, as its authors
    tuned them, where each is valid here; {} when the folder has none (or a file that does not parse)."""
    path = Path(folder) / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    found = {}
    for name in NEUTRAL.keys() & config.keys():
        with contextlib.suppress(InvalidSampling):  # a value out of this server's range: left neutral
            found[name] = LIMITS[name].check(name, config[name])
    return found


def _stop_strings(name: str, value) -> tuple[str, ...]:
    """A stop string, or a list of up to 4, as a tuple; anything else is an `InvalidSampling`."""
    stops = (value,) if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise InvalidSampling(name, f"{name} must be a string or a list of up to 4 non-empty strings, got {value!r:.80}")
    return tuple(stops)


BIAS = Limit(-100, 100)
MAX_BIASED = 300  # tokens one request may bias (OpenAI's limit)


def _logit_bias(name: str, value) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (JSON keys are strings), or the (id, bias) pairs themselves, as
    sorted pairs; whether an id is in the vocabulary is the engine's check."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)) or len(pairs) > MAX_BIASED:
        raise InvalidSampling(name, f"{name} must map up to {MAX_BIASED} token ids to numbers, got {value!r:.80}")
    out = {}
    for token, bias in pairs:
        ident = token if isinstance(token, int) and not isinstance(token, bool) else \
            int(token) if isinstance(token, str) and token.isdigit() else None
        if ident is None:
            raise InvalidSampling(name, f"{name}'s keys must be token ids (whole numbers), got {token!r:.40}")
        out[ident] = BIAS.check(name, bias)
    return tuple(sorted(out.items()))


LISTS = {"stop": _stop_strings, "logit_bias": _logit_bias}  # settings that are not one number
