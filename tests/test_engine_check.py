"""The LLM engine check (`check_llm`) that a TensorRT-LLM engine must pass before it is used, run here on
torch engines in its place (TensorRT-LLM cannot be installed): the same weights pass, an engine that
computes something else is refused, and one that ignores its prompt table is refused on image prompts."""

import copy
import dataclasses

import pytest
import torch

from engine_builder.engine_check import check_llm
from pipeline.llm.model.loading import load_decoder
from pipeline.llm.engine.torch_engine import TorchLLMEngine
from pipeline.llm.text.prompt import Prompt

IMAGE_QUERIES, SCALE = 8, 1.0


@pytest.fixture(scope="module")
def model(qwen2_demo):
    return load_decoder(qwen2_demo)


def engine_of(model) -> TorchLLMEngine:
    return TorchLLMEngine(model, 256, model.config.vocab_size, max_batch=1)


class IgnoresTable:
    """An engine that drops the prompt table (as TensorRT-LLM does for ids below the embedding's size)."""

    def __init__(self, inner: TorchLLMEngine):
        self.inner, self.hidden_size = inner, inner.hidden_size

    def submit(self, prompt: Prompt, *args, **kwargs):
        if prompt.slots:
            prompt = dataclasses.replace(prompt, embeds=tuple(torch.zeros_like(e) for e in prompt.embeds),
                                         keys=tuple("none" for _ in prompt.keys))
        return self.inner.submit(prompt, *args, **kwargs)


def test_the_same_weights_pass_with_text_and_image_prompts(model):
    engine, reference = engine_of(model), engine_of(model)
    try:
        verdict = check_llm(engine, reference, "none", IMAGE_QUERIES, SCALE)
    finally:
        engine.close()
        reference.close()
    assert verdict.passed, verdict
    assert "text: greedy agreement 1.00" in verdict.numbers and "image 1: greedy agreement 1.00" in verdict.numbers
    assert "two images give different answers" in verdict.numbers  # the probe images do change the reply


def test_an_engine_on_other_weights_is_refused(model):
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        for p in wrong.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * p.float().std())
    engine, reference = engine_of(wrong), engine_of(model)
    try:
        verdict = check_llm(engine, reference, "int4", 0, SCALE)
    finally:
        engine.close()
        reference.close()
    assert not verdict.passed and "text: greedy agreement" in verdict.numbers, verdict


def test_an_engine_that_ignores_its_prompt_table_is_refused(model):
    inner, reference = engine_of(model), engine_of(model)
    try:
        verdict = check_llm(IgnoresTable(inner), reference, "none", IMAGE_QUERIES, SCALE)
    finally:
        inner.close()
        reference.close()
    assert not verdict.passed and "two images give the same answer" in verdict.numbers, verdict
    assert "text: greedy agreement 1.00" in verdict.numbers  # text alone could not have told
