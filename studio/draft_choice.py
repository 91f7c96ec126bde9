"""Which weights a draft model runs in: on a GPU, float or int4, whichever decodes faster there, timed at
the first launch and kept beside the engine cache.

Why measured: a draft model is small (Qwen2.5-0.5B for a 7B chat model), and at that size a decode
step is bound by launches and latency as much as by its weight bytes: int4 reads a quarter of the
bytes, but its GEMVs reach a smaller share of the bandwidth on narrow layers (bench/RESULTS.md, issue
32 part 2), so which is faster depends on the GPU and the model. Elsewhere the draft runs as the chat
model's `--quant` says (on the CPU, quantized layers run on torch's CPU kernels).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.files import atomic_write
from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.language_model import LanguageModel
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.text.tokenizer import Tokenizer

GPU_MODES = ("none", "int4")
PROBE = Prompt(tuple(range(1, 33)))  # a fixed prompt: the speed of a step does not depend on the words
PROBE_TOKENS = 48


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers give the same ids (a draft model's tokens must mean the target's)."""
    probe = "Speculative decoding: 12 drafts, ünïcode ✓, code `x += 1`\n"
    return a.vocab_size == b.vocab_size and a.encode(probe) == b.encode(probe) and a.eos_ids == b.eos_ids


def draft_modes(device: str, quant: str) -> tuple[str, ...]:
    """The weights a draft model may run in: on a GPU float and int4 (the faster is kept), else `quant`."""
    return GPU_MODES if device.startswith("cuda") else (quant,)


def record_name(what: str, name: str, kernels_file: str) -> str:
    """The file that keeps `what` was measured for `name` on this GPU and kernel version (`kernels_file`: the
    low-bit kernels' tuned-configs file name, which names both): a draft model's choice of weights, a chat
    model's verify costs."""
    return f"{what}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{kernels_file}"


def decode_speed(model: LanguageModel) -> float:
    """Greedy decode tokens per second, the better of two replies of PROBE_TOKENS (the first compiles and
    captures what a first step needs); no end-of-text stop, so every reply has its full length."""
    params = SamplingParams(max_new_tokens=PROBE_TOKENS, temperature=0, repetition_penalty=1.0)
    speeds = []
    for _ in range(2):
        stream = model.engine.submit(PROBE, params, set())
        stream.wait()
        speeds.append(stream.stats.tokens_per_s)
    return max(speeds)


def fastest_draft(load: Callable[[str], LanguageModel], modes: tuple[str, ...], record: Path | None,
                  say: Callable[[str], None]) -> LanguageModel:
    """The draft model loaded by `load(mode)` in the fastest of `modes`: the one `record` kept from an
    earlier launch, else each timed (`decode_speed`) with at most two loaded at once, the choice and the
    speeds written to `record` (atomically). A damaged or stale record is timed again, not trusted.
    Weights that do not load (their files, out of memory) are said and skipped, and nothing is written
    (the next launch tries again); where none load, a `UserError`."""
    stored = _read(record)
    if stored in modes or len(modes) == 1:
        return load(stored if stored in modes else modes[0])
    say(f"timing the draft model in {' and '.join(_label(m) for m in modes)} on this GPU (once; kept)")
    best: tuple[str, LanguageModel] | None = None
    speeds: dict[str, float] = {}
    failed: list[str] = []
    for mode in modes:
        try:
            model = load(mode)
        except (UserError, torch.cuda.OutOfMemoryError) as e:  # the other weights may still load and run
            say(f"the draft model in {_label(mode)} did not load ({e})")
            failed.append(f"{_label(mode)}: {e}")
            continue
        speeds[mode] = round(decode_speed(model), 1)
        if best is None or speeds[mode] > speeds[best[0]]:
            if best is not None:
                best[1].close()
            best = (mode, model)
        else:
            model.close()
    if best is None:
        raise UserError("; ".join(failed))
    say("draft model decode: " + ", ".join(f"{_label(m)} {s} tok/s" for m, s in speeds.items())
        + f"; runs in {_label(best[0])}")
    if record is not None and not failed:
        atomic_write(record, json.dumps({"quant": best[0], "tokens_per_s": speeds}, indent=1))
    return best[1]


def _read(record: Path | None) -> str | None:
    if record is None or not record.is_file():
        return None
    try:
        quant = json.loads(record.read_text()).get("quant")
    except (ValueError, AttributeError):
        return None
    return quant if isinstance(quant, str) else None


def _label(mode: str) -> str:
    return "float" if mode == "none" else mode
