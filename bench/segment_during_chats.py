"""A SAM click while chats generate, on the GPU, in one process as the app runs them (no HTTP).

SAM ViT-H (random weights, bf16 encoder, captured click graphs) and the chat engine at Qwen2.5-7B
shapes share the GPU. Times `SegmentPipeline.predict` on a cached photo alone, then while 4 chats
stream long replies, and the engine's decode step over the same window. The claim checked: a click
waits at most about one decode step for the chats (and, the other way round, how many decode
steps the chats get while clicks run back to back). Prints a table; writes segment_during_chats.json.

    python bench/segment_during_chats.py
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from studio.compose import GIL_SWITCH_S  # noqa: E402
from llm_engine import random_prompt, random_qwen25_7b  # noqa: E402
from timing import report  # noqa: E402
from studio.backends import sam_engine  # noqa: E402
from pipeline.images import load_image  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402
from pipeline.sam.model import VARIANTS, Sam  # noqa: E402
from pipeline.pipelines.segment import SegmentPipeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def clicks_ms(seg: SegmentPipeline, handle, n: int = 30) -> list[float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        seg.predict(handle, [[100 + 20 * i, 300]], [1])
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    sys.setswitchinterval(GIL_SWITCH_S)  # as launch.py sets it
    with torch.device("cuda"):
        sam = Sam(VARIANTS["vit_h"]).eval()
    sam.image_encoder.to(torch.bfloat16)
    seg = SegmentPipeline(sam_engine(sam))
    handle = seg.set_image(load_image(str(ROOT / "assets/examples/street.jpg")))
    clicks_ms(seg, handle, 5)  # captures the click graph
    alone = clicks_ms(seg, handle)

    model = random_qwen25_7b()
    engine = TorchLLMEngine(model, 8192, model.config.vocab_size, max_batch=8, rows=8)
    endless = SamplingParams(max_new_tokens=4000, temperature=0, repetition_penalty=1.0)
    with torch.inference_mode():
        list(engine.submit(Prompt(random_prompt(1, 128)), SamplingParams(max_new_tokens=600, temperature=0), set()))
    streams = [engine.submit(Prompt(random_prompt(10 + i, 128)), endless, set()) for i in range(4)]
    readers = [threading.Thread(target=s.wait) for s in streams]
    for t in readers:
        t.start()
    while engine.status()["running"] < 4:
        time.sleep(0.01)
    time.sleep(1.0)  # past the first graph captures of the batch bucket
    steps, start = engine.steps, time.perf_counter()
    time.sleep(1.0)
    step_ms = (time.perf_counter() - start) * 1e3 / max(engine.steps - steps, 1)
    steps, start = engine.steps, time.perf_counter()
    during = clicks_ms(seg, handle)
    window_ms = (time.perf_counter() - start) * 1e3
    steps_during = engine.steps - steps
    running = engine.status()["running"]
    for s in streams:
        s.cancel()
    for t in readers:
        t.join()
    engine.close()
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "click_alone_ms": round(statistics.median(alone), 2),
           "click_during_4_chats_ms": round(statistics.median(during), 2),
           "click_during_4_chats_p90_ms": round(sorted(during)[int(0.9 * len(during))], 2),
           "decode_step_ms_4_chats": round(step_ms, 2), "chats_running_after_clicks": running,
           "clicks_window_ms": round(window_ms, 1), "decode_steps_during_clicks": steps_during}
    res["extra_delay_ms"] = round(res["click_during_4_chats_ms"] - res["click_alone_ms"], 2)
    report("segment_during_chats", res)


if __name__ == "__main__":
    main()
