"""Tools on demand under a memory budget: the least recently used idle tool is unloaded to make room,
a busy one never is, and a request for an unloaded tool loads it again. Sizes are measured for real
(on the CPU: the bytes of live tensors)."""

import threading
import time

import numpy as np
import pytest
import torch

from studio import compose
from studio.config import parse_config
from studio.plan import make_plan
from studio.sizes import weights_size
from conftest import TEST_MODEL
from studio.startup_report import StartupReport
from pipeline.errors import UserError
from pipeline.llm.engine.params import SamplingParams
from pipeline.service.tools import ToolHost, ToolSpec

MIB = 2**20


class Holder:
    """A tool that holds `mib` MiB of tensors until closed."""

    def __init__(self, mib: int):
        self.weights = torch.zeros(mib * MIB, dtype=torch.uint8)
        self.closed = False

    def close(self):
        self.weights, self.closed = None, True


def host_with(sizes: dict[str, int], budget_mib: int, needs: dict[str, tuple] | None = None):
    lines: list[str] = []
    host = ToolHost(torch.device("cpu"), budget_mib * MIB, lines.append)
    for name, mib in sizes.items():
        host.add(ToolSpec(name, lambda say, free, mib=mib: Holder(mib), estimate=mib * MIB,
                          needs=(needs or {}).get(name, ())))
    return host, lines


def test_the_least_recently_used_idle_tool_is_unloaded_and_reloads_on_demand():
    host, lines = host_with({"chat": 64, "image chat": 48, "segment": 32}, budget_mib=130)
    with host.using("chat"):
        pass
    with host.using("segment"):
        pass
    chat = host.loaded("chat")
    with host.using("chat"):  # chat is now the more recently used of the two
        pass
    with host.using("image chat") as image_chat:  # 64 + 32 + 48 > 130: segment (idle, least recent) goes
        assert isinstance(image_chat, Holder)
    assert host.loaded("segment") is None and host.loaded("chat") is chat
    assert any(line.startswith("unloaded segment (32 MiB) to make room for image chat under the") for line in lines)
    assert 63 * MIB < host._slots["chat"].size < 66 * MIB  # measured, not the estimate
    assert host.status()["segment"] == "not loaded (unloaded; loads again when used)"

    with host.using("segment") as segment:  # reloaded on demand; now chat is the least recent
        assert isinstance(segment, Holder) and host.loads("segment") == 2
    assert host.loaded("chat") is None and chat.closed
    assert host.loaded("image chat") is not None


def test_a_busy_tool_is_never_unloaded_and_a_full_budget_says_why():
    host, lines = host_with({"chat": 64, "image chat": 48, "segment": 32}, budget_mib=120)
    in_use = threading.Event()
    with host.using("chat"):
        with host.using("segment"):
            pass
        with host.using("image chat"):  # segment is idle: it goes; chat is busy: it stays
            in_use.set()
            assert host.loaded("chat") is not None and host.loaded("segment") is None
            with pytest.raises(UserError, match=r"segment needs about 32 MiB but the 120 MiB GPU budget is held "
                                                r"by tools in use \(chat 64 MiB in use, image chat 48 MiB in use\)"):
                with host.using("segment"):
                    pass
    assert in_use.is_set()


def test_a_tool_estimated_over_the_budget_still_loads_when_it_would_be_alone():
    """The estimate before a first load is its files' size, which over-states quantized or down-cast
    weights (a 13.5 GB bf16 Vicuna is 4 GB in int4): with nothing else to unload, it is tried."""
    lines: list[str] = []
    host = ToolHost(torch.device("cpu"), 100 * MIB, lines.append)
    host.add(ToolSpec("chat", lambda say, free: Holder(30), estimate=30 * MIB))
    host.add(ToolSpec("image chat", lambda say, free: Holder(40), estimate=160 * MIB))
    with host.using("chat"):
        pass
    with host.using("image chat") as image_chat:
        assert isinstance(image_chat, Holder)
    assert host.loaded("chat") is None  # unloaded first: the estimate did not fit beside it
    assert any("image chat may need 160 MiB, more than the 100 MiB budget; nothing else is loaded" in line
               for line in lines)


def test_a_tool_that_needs_another_goes_with_it():
    host, lines = host_with({"chat": 64, "image chat": 16, "segment": 40}, budget_mib=100,
                            needs={"image chat": ("chat",)})
    with host.using("image chat"):
        assert host.loaded("chat") is not None  # loaded first
    with host.using("segment"):  # 64 + 16 + 40 > 100: chat is least recent, and image chat needs it
        pass
    assert host.loaded("chat") is None and host.loaded("image chat") is None
    assert [line.split(" (")[0] for line in lines if line.startswith("unloaded")] == ["unloaded image chat",
                                                                                      "unloaded chat"]


def test_the_real_tools_load_on_first_use_and_make_room_for_each_other(studio_cache, monkeypatch):
    """The app's own loaders (demo models): start-up loads chat only; with a budget that holds two of the
    three tools, using the third unloads the least recently used, which reloads and answers again."""
    monkeypatch.setenv("STUDIO_CACHE", str(studio_cache))
    args = parse_config(["--device", "cpu", "--model", TEST_MODEL])
    plan = make_plan(args)
    engines = compose.engine_options(args, out=None)
    host = ToolHost(torch.device("cpu"), None, engines.report.say)
    for spec in compose.tool_specs(args, plan, engines, host):
        host.add(spec)
    host.load("chat")
    assert host.status()["image chat"] == "not loaded" and host.status()["segment"] == "not loaded"
    progress: list[str] = []
    with host.using("segment", progress.append) as segment:
        segment.set_image(np.zeros((32, 48, 3), dtype=np.uint8))
    assert any(line.startswith("segment: SAM") for line in progress)  # the requester heard the load
    with host.using("image chat"):
        pass
    sizes = {name: host._slots[name].size for name in host.names}
    assert all(sizes.values()), sizes
    host.budget = sizes["chat"] + sizes["image chat"] + sizes["segment"] // 2  # room for two of the three
    try:
        with host.using("chat") as chat:  # the most recent: segment is the least recently used
            reply = "".join(e.text for e in chat.stream([{"role": "user", "content": "hi"}],
                                                        SamplingParams(max_new_tokens=3, temperature=0)))
        with host.using("image chat"):
            pass
        with host.using("segment") as segment:  # already loaded: nothing moves
            pass
        with host.using("chat"):
            pass
        # loading nothing new unloads nothing, even over budget; a reload of an unloaded tool makes room
        host.unload("segment", "for the test")
        with host.using("segment") as segment:
            assert not segment.closed and host.loads("segment") == 2
        assert host.loaded("image chat") is None, host.status()  # the least recently used went
        assert any(line.startswith("unloaded image chat") for line in engines.report.lines)
        with host.using("chat") as chat:
            again = "".join(e.text for e in chat.stream([{"role": "user", "content": "hi"}],
                                                        SamplingParams(max_new_tokens=3, temperature=0)))
        assert again == reply
        with host.using("image chat") as image_chat:  # reloaded on demand
            assert host.loads("image chat") == 2 and image_chat.encoder is not None
    finally:
        host.close()


def test_startup_report_listeners_hear_lines_only_inside_their_block():
    report, heard = StartupReport(out=None), []
    report.say("before")
    with report.listening(heard.append):
        report.say("during")
    report.say("after")
    assert heard == ["during"] and report.lines == ["before", "during", "after"]


def test_sizes_before_a_first_load_count_floats_at_the_loading_width(tmp_path):
    """A float32 file loaded in bfloat16 takes half its size (SAM-H: 2.6 GB on disk, 1.3 GB loaded);
    integer tensors keep theirs; an index that cannot be read falls back to the size on disk."""
    from safetensors.torch import save_file

    from pipeline.weights_io import loaded_bytes, write_weight_file

    tensors = {"w": torch.zeros(1000, 250), "ids": torch.zeros(1000, dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    write_weight_file(tmp_path / "b.pth", tensors)
    for name in ("a.safetensors", "b.pth"):
        assert loaded_bytes(tmp_path / name, torch.bfloat16) == 250_000 * 2 + 8_000
        assert loaded_bytes(tmp_path / name, torch.float32) == 250_000 * 4 + 8_000
    (tmp_path / "c.pth").write_bytes(b"\x80" + b"x" * 99)  # a damaged pickle
    assert loaded_bytes(tmp_path / "c.pth", torch.bfloat16) == 100
    assert weights_size(tmp_path, dtype=torch.bfloat16) == 2 * (250_000 * 2 + 8_000) + 100


class SlowTool:
    """A tool whose load takes `seconds` (a first launch's compile and quantization, in small)."""

    loads = 0

    def __init__(self, seconds: float):
        time.sleep(seconds)
        SlowTool.loads += 1

    def close(self):
        pass


def test_a_tool_loading_blocks_no_other_tools_requests_and_loads_once(qwen2_demo):
    """While a tool takes 5 s to load, five chat replies started during the load finish within 0.5 s of
    their time with no load running (the same greedy replies, so the same work); two first requests to
    the loading tool both wait for one load."""
    from pipeline.pipelines.chat import ChatPipeline
    from pipeline.service.studio import StudioService
    from studio.backends import load_language_model

    host = ToolHost(torch.device("cpu"), None, lambda line: None)
    host.add(ToolSpec("chat", lambda say, free: ChatPipeline(load_language_model(qwen2_demo, "demo/qwen2-tiny"),
                                                            is_demo=True), estimate=0))
    host.add(ToolSpec("slow", lambda say, free: SlowTool(5.0), estimate=0))
    host.load("chat")
    service = StudioService(host)  # the path every front end's request takes
    sampling = dict(max_new_tokens=48, temperature=0, repetition_penalty=1.0)

    def five_replies() -> tuple[float, list[str]]:
        texts: list[str] = [""] * 5

        def reply(i: int) -> None:
            turn = service.chat_turn([{"role": "user", "content": f"question {i}"}], sampling)
            for update in service.reply(f"client-{i}", turn):
                texts[i] += update.text
        start = time.perf_counter()
        threads = [threading.Thread(target=reply, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start, texts

    five_replies()  # warm
    alone, expected = five_replies()
    got = []
    loaders = [threading.Thread(target=lambda: got.append(host.load("slow"))) for _ in range(2)]
    for t in loaders:
        t.start()
    time.sleep(0.2)  # the load is under way
    during, texts = five_replies()
    assert host.loaded("slow") is None, "the replies must have run while the tool was still loading"
    for t in loaders:
        t.join()
    assert texts == expected and all(expected)
    assert during <= alone + 0.5, (during, alone)
    assert SlowTool.loads == 1 and host.loads("slow") == 1 and got[0] is got[1]


def test_a_replaced_tool_serves_requests_in_flight_then_closes_and_its_dependents_follow():
    """A model switch: the request holding the old chat keeps it until it ends; every later request
    gets the new one; image chat (which needs chat) is replaced with it; the old one is closed and no
    longer counted in the budget once its last request ends."""
    host, lines = host_with({"chat": 16, "image chat": 8}, budget_mib=100, needs={"image chat": ("chat",)})
    with host.using("image chat"):
        pass
    with host.using("chat") as old:
        host.replace([ToolSpec("chat", lambda say, free: Holder(24), estimate=24 * MIB),
                      ToolSpec("image chat", lambda say, free: Holder(8), estimate=8 * MIB, needs=("chat",))],
                     "switched to another model")
        assert not old.closed and host.loaded("chat") is None  # still this request's; not the host's any more
        assert any("request(s) in progress finish on the old model" in line for line in lines)
        with host.using("chat") as new:
            assert new is not old and new.weights.numel() == 24 * MIB
            assert host._in_use() >= 40 * MIB  # both counted while the old one finishes
    assert old.closed and host._in_use() < 40 * MIB
    assert host.loaded("image chat") is None  # its old pipeline held the old chat: replaced too
