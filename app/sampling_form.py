"""The sampling controls of the chat tabs, made from `SamplingParams` itself: its fields (names and
order), its defaults and its `LIMITS`. Nothing here restates a default or a range, so the page, the
API and the terminal cannot drift apart; the form also unpacks a handler's values by component, so
no handler depends on the order of its inputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import gradio as gr

from pipeline.llm.engine.params import LIMITS, SamplingParams

# The settings the page shows (the API takes every field); labels and slider steps are the page's own words.
LABELS = {"temperature": "Temperature (0 = greedy)", "top_p": "Top-p", "top_k": "Top-k (0 = off)",
          "repetition_penalty": "Repetition penalty", "max_new_tokens": "Max new tokens", "seed": "Seed (-1 = random)"}
STEPS = {"temperature": 0.05, "top_p": 0.05, "top_k": 1, "repetition_penalty": 0.01, "max_new_tokens": 1}
UI_MAX = {"max_new_tokens": 4096}  # a slider's usable span; typing a larger value in its box still works
SHOWN = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name in LABELS)


class SamplingForm:
    """The controls, in `SamplingParams`' field order, inside an accordion; element ids start with `tab`."""

    def __init__(self, tab: str, **defaults: Any):
        """`defaults` override `SamplingParams`' own for this tab (image chat's shorter replies)."""
        start = dataclasses.replace(SamplingParams(), **defaults)
        self.controls: dict[str, gr.components.Component] = {}
        with gr.Accordion("Sampling", open=True):
            for name in SHOWN:
                element = f"{tab}-{name.replace('_', '-')}"
                if name in STEPS:
                    limit = LIMITS[name]
                    low = limit.low + (STEPS[name] if limit.low_open else 0)
                    self.controls[name] = gr.Slider(low, UI_MAX.get(name, limit.high), value=getattr(start, name),
                                                    step=STEPS[name], label=LABELS[name], elem_id=element)
                else:  # the seed: None (random) shows as -1, which `from_values` reads back as None
                    value = getattr(start, name)
                    self.controls[name] = gr.Number(-1 if value is None else value, precision=0, label=LABELS[name],
                                                    elem_id=element)

    @property
    def components(self) -> set:
        return set(self.controls.values())

    def values(self, data: dict) -> dict[str, Any]:
        """The settings in a handler's `data` (Gradio's {component: value}), for `SamplingParams.from_values`."""
        return {name: data[control] for name, control in self.controls.items()}
