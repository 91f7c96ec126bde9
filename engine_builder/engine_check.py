"""The check a built engine must pass before it serves anything: the torch reference on fixed probe inputs.

Vision engines (`check_engine`) are compared output by output; LLM engines (`check_llm`) by their
greedy tokens against the float torch engine, with image prompts where they take a prompt table.

Why: an engine can load and still compute something else (a builder bug, a precision that does not
hold, a file changed under consistent metadata). So every engine is run once on seeded probe inputs
beside the module it was exported from, in float32, and compared output by output: relative error
within what its precision allows, SAM's masks by IoU, and for MiniGPT-4's vision side, that two
different images give different embeddings (an engine that ignores its input would otherwise pass
on one probe). The verdict is kept with the engine (`EngineCache`).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from engine_builder.cache import Verdict
from engine_builder.onnx_export import GraphSpec, TensorSpec
from pipeline.engine_session import Session
from pipeline.llm.engine.seam import LLMEngine
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.prompt import Prompt

TOLERANCE = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 8e-2}  # relative error of each output
MIN_MASK_IOU = {"float32": 0.99, "float16": 0.9, "bfloat16": 0.9}
DISTINCT = 1e-3  # two probe images must give embeddings at least this far apart (relative)
FILLS = {"point_labels": 1.0, "has_mask_input": 0.0, "mask_input": 0.0}  # inputs with meaningful constants
SCALES = {"point_coords": 1024.0}  # probe points inside SAM's input frame


def probe_input(spec: TensorSpec, seed: int) -> Tensor:
    """A seeded input at the profile's optimal shape."""
    shape = spec.shapes[1]
    if spec.name in FILLS:
        return torch.full(shape, FILLS[spec.name], dtype=spec.dtype)
    values = torch.rand(shape, generator=torch.Generator().manual_seed(seed))
    return (values * SCALES.get(spec.name, 2.0) - (0 if spec.name in SCALES else 1.0)).to(spec.dtype)


def relative_error(got: Tensor, expected: Tensor) -> float:
    got, expected = got.float().cpu(), expected.float().cpu()
    return float((got - expected).norm() / expected.norm().clamp(min=1e-12))


@torch.inference_mode()
def check_engine(spec: GraphSpec, module: nn.Module, session: Session, precision: str) -> Verdict:
    """Run `session` and the float32 torch reference of `module` on the same probe inputs; compare."""
    device = next(module.parameters()).device
    reference = copy.deepcopy(spec.make(module)).float().eval()  # copies only the parts this graph uses
    results, seeds = [], (0, 1) if spec.component == "minigpt4_vision" else (0,)
    for seed in seeds:
        feeds = {t.name: probe_input(t, seed) for t in spec.inputs}
        expected = reference(*(v.to(device) for v in feeds.values()))
        expected = expected if isinstance(expected, (tuple, list)) else (expected,)
        got = session.run(feeds)
        results.append((got, expected))
    tolerance, checks, passed = TOLERANCE[precision], [], True
    got, expected = results[0]
    for name, a, b in zip(spec.outputs, got, expected):
        err = relative_error(a, b)
        passed &= err <= tolerance
        checks.append(f"{name} error {err:.2g} (≤ {tolerance:g})")
        if name == "masks":
            a, b = a.float().cpu() > 0, b.float().cpu() > 0
            iou = float((a & b).sum() / (a | b).sum().clamp(min=1))
            passed &= iou >= MIN_MASK_IOU[precision]
            checks.append(f"mask IoU {iou:.3f} (≥ {MIN_MASK_IOU[precision]:g})")
    if len(results) == 2:
        apart = relative_error(results[1][0][0], results[0][0][0])
        passed &= apart >= DISTINCT
        checks.append(f"two images {apart:.2g} apart (≥ {DISTINCT:g})")
    return Verdict(bool(passed), f"{spec.component} against torch on probe inputs", "; ".join(checks))


LLM_PROBE_TOKENS = 16  # greedy tokens compared per probe prompt
MIN_AGREEMENT = {"none": 0.75, "int8": 0.5, "int4": 0.25}  # share of them equal to the float torch engine's


def check_llm(engine: LLMEngine, reference: LLMEngine, quant: str, image_queries: int = 0,
              embed_scale: float = 0.02) -> Verdict:
    """An LLM engine against the float torch engine on the same weights: greedy tokens of a probe prompt
    agree at least `MIN_AGREEMENT[quant]` (weight quantization changes some; a wrong engine agrees by
    chance only), and with `image_queries`, so do two prompts with different random "images" in a
    prompt-table slot, whose answers must differ from each other where the reference's do (an engine
    that reads no table answers both alike)."""
    greedy = SamplingParams(max_new_tokens=LLM_PROBE_TOKENS, temperature=0, repetition_penalty=1.0)
    prompts = {"text": Prompt(tuple(range(3, 27)))}
    for seed in (0, 1) if image_queries else ():
        image = torch.randn(image_queries, reference.hidden_size, generator=torch.Generator().manual_seed(seed))
        ids = tuple(range(3, 7)) + (0,) * image_queries + tuple(range(7, 15))
        prompts[f"image {seed}"] = Prompt(ids, ((4, image_queries),), (image * embed_scale,), (f"probe-{seed}",))
    got = {name: list(engine.submit(p, greedy, set())) for name, p in prompts.items()}
    want = {name: list(reference.submit(p, greedy, set())) for name, p in prompts.items()}
    minimum, checks, passed = MIN_AGREEMENT[quant], [], True
    for name in prompts:
        agree = sum(a == b for a, b in zip(got[name], want[name])) / LLM_PROBE_TOKENS
        passed &= agree >= minimum
        checks.append(f"{name}: greedy agreement {agree:.2f} (≥ {minimum:g})")
    if image_queries and want["image 0"] != want["image 1"]:
        differ = got["image 0"] != got["image 1"]
        passed &= differ
        checks.append("two images give different answers" if differ else "two images give the same answer")
    return Verdict(bool(passed), f"LLM ({quant} weights) against the float torch engine", "; ".join(checks))
