"""A draft model runs in the weights that decode fastest where it runs (`studio/draft_choice.py`): each
candidate is loaded and timed once, the faster kept and written down, a later launch loads only what
was written, and a damaged record is timed again. Timed here on the CPU between float and int8 (on a
GPU the candidates are float and int4); which one wins is this machine's business, so the tests check
that the one kept is the one measured faster, not which it is."""

import json

import pytest
import torch

from pipeline.llm.engine.params import SamplingParams
from pipeline.llm.text.prompt import Prompt
from studio.backends import load_language_model
from studio.draft_choice import draft_modes, fastest_draft, record_name

MODES = ("none", "int8")
GREEDY = SamplingParams(max_new_tokens=4, temperature=0, repetition_penalty=1.0)


def loader(folder, loads: list[str]):
    def load(mode: str):
        loads.append(mode)
        return load_language_model(folder, "demo/qwen2-tiny", "torch", "cpu", torch.float32, 128, 2, quant=mode,
                                   speculate="off")
    return load


def test_the_draft_model_is_kept_in_the_weights_measured_fastest_and_the_choice_is_reused(qwen2_demo, tmp_path):
    record = tmp_path / record_name("draft", "demo/qwen2-tiny", "lowbit-GPU-v6.json")
    said: list[str] = []
    loads: list[str] = []
    draft = fastest_draft(loader(qwen2_demo, loads), MODES, record, said.append)
    stored = json.loads(record.read_text())
    speeds = stored["tokens_per_s"]
    assert loads == list(MODES) and set(speeds) == set(MODES) and all(v > 0 for v in speeds.values())
    assert stored["quant"] == max(speeds, key=speeds.get)  # the faster one, as measured
    assert ("int8" in draft.description) == (stored["quant"] == "int8")
    assert any("timing the draft model in float and int8" in line for line in said), said
    assert any("runs in" in line for line in said), said
    assert len(list(draft.engine.submit(Prompt(tuple(range(1, 9))), GREEDY, set()))) == 4  # it still runs
    draft.close()

    said.clear()
    loads.clear()
    again = fastest_draft(loader(qwen2_demo, loads), MODES, record, said.append)  # a later launch: no timing
    assert loads == [stored["quant"]] and said == []
    again.close()

    record.write_text('{"quant": ')  # damaged: measured again, not trusted
    loads.clear()
    fastest_draft(loader(qwen2_demo, loads), MODES, record, said.append).close()
    assert loads == list(MODES) and json.loads(record.read_text())["quant"] in MODES


def test_weights_that_do_not_load_are_said_and_skipped(qwen2_demo, tmp_path):
    """One candidate failing to load (here its files are refused; on a GPU, out of memory) leaves the
    other, said, and no record (the next launch tries both again); none loading is a `UserError`."""
    from pipeline.errors import UserError

    record = tmp_path / "draft.json"
    said: list[str] = []
    load = loader(qwen2_demo, [])

    def int8_fails(mode: str):
        if mode == "int8":
            raise UserError("its weights are damaged")
        return load(mode)

    draft = fastest_draft(int8_fails, MODES, record, said.append)
    assert "int8" not in draft.description and not record.exists()
    assert any("int8 did not load (its weights are damaged)" in line for line in said), said
    draft.close()

    def nothing_loads(mode: str):
        raise UserError(f"no {mode}")

    with pytest.raises(UserError, match="float: no none; int8: no int8"):
        fastest_draft(nothing_loads, MODES, record, said.append)


def test_draft_weights_are_measured_on_a_gpu_and_follow_the_chat_model_elsewhere():
    assert draft_modes("cuda", "int8") == ("none", "int4") and draft_modes("cuda:1", "none") == ("none", "int4")
    assert draft_modes("cpu", "int8") == ("int8",)
