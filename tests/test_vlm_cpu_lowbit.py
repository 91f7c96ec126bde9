"""Image chat's decoder on the CPU takes the chat model's low-bit path (issue 50): `--quant auto` (and int8) runs a
SmolVLM's float decoder as 8-bit blocks (gguf-py's Q8_0 rounding) on the ONNX Runtime engine a GGUF file runs on,
built once into the engine cache; its replies stay those of the float decoder within int8 rounding. On a tiny
random SmolVLM as `save_pretrained` writes one, its decoder 64 wide (whole blocks of 32)."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")
pytest.importorskip("onnxruntime")

from test_smolvlm import IMAGES, make_folder  # noqa: E402
from test_smolvlm_chat import TEMPLATE, TURNS  # noqa: E402
from engine_builder.build import EngineOptions  # noqa: E402
from engine_builder.cache import EngineCache  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.model.kv_cache import KVCache  # noqa: E402
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables
from studio.startup_report import StartupReport  # noqa: E402
from studio.vlm import CPU_AUTO, load_vlm  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = make_folder(tmp_path_factory.mktemp("smolvlm64"), text_width=64)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits for `ids` read as one prompt, in a fresh cache."""
    cache = KVCache(model.config, 1, 64, torch.float32, torch.device("cpu"))
    return model(cache, RotaryTables(model.config, 64, torch.device("cpu")), (Prefill(0, 0),),
                 tokens=torch.tensor([ids]))[0]


def reply(chat, steps: int = 6) -> tuple[str, list[float]]:
    params = SamplingParams(max_new_tokens=steps, temperature=0, repetition_penalty=1.0, logprobs=1)
    events = list(chat.stream(IMAGES["37x300"], TURNS, params))
    return "".join(e.text for e in events), [t.logprob for e in events for t in e.logprobs or []]


def test_auto_on_the_cpu_runs_the_decoder_as_8_bit_blocks_on_onnx_runtime_and_answers_as_the_float_one(folder,
                                                                                                       tmp_path):
    options = EngineOptions(EngineCache(tmp_path / "engines"), StartupReport(out=None))
    full = load_vlm(folder, "tiny-smolvlm", "cpu", torch.float32, 2, "none")
    lines: list[str] = []
    chat = load_vlm(folder, "tiny-smolvlm", "cpu", torch.float32, 2, "auto", options, lines.append)
    try:
        assert f"image chat: --quant int8 ({CPU_AUTO})" in lines, lines
        assert type(chat.llm.engine.runner.model).__name__ == "OnnxDecoder"
        assert "int8 weights (Q8_0 blocks on ONNX Runtime" in chat.description, chat.description
        ids = list(range(5, 45))
        ours, theirs = logits(chat.llm.engine.runner.model, ids), logits(full.llm.engine.runner.model, ids)
        error = ((ours - theirs).norm() / theirs.norm()).item()
        assert error < 0.03, error  # int8 weights and int8 inputs per block of 32: 0.008 seen (rows flipped: 1.4)
        text, low = reply(chat)
        _, floats = reply(full)
        assert len(low) == 6 and text
        assert np.allclose(low, floats, atol=0.02), (low, floats)  # 0.004 seen
    finally:
        chat.close()
        full.close()
    # a later launch maps the engine the first one built
    again = load_vlm(folder, "tiny-smolvlm", "cpu", torch.float32, 2, "int8", options)
    try:
        assert type(again.llm.engine.runner.model).__name__ == "OnnxDecoder"
        assert np.allclose(reply(again)[1], low, atol=1e-6)
        built = [line for line in options.report.lines if "ONNX Runtime engine" in line]
        assert len([line for line in built if "engine built in" in line]) == 1, built
        assert "loaded from cache" in built[-1], built
    finally:
        again.close()
