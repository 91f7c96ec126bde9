"""Image chat's default model, SmolVLM, downloaded on first use from a local hub (tests/hub_server.py) as
`save_pretrained` writes one (a tiny random SmolVLM with SmolVLM-Instruct's chat template), answering about a
picture through the app's service; offline with nothing cached the MiniGPT-4 demo runs and the start-up report
says what one download would give."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")

from hub_server import serving  # noqa: E402
from test_smolvlm import folder  # noqa: E402,F401 - the tiny checkpoint fixture
from test_smolvlm_chat import TEMPLATE  # noqa: E402
from test_qwen_vl_chat import folder as qwen_vl_folder  # noqa: E402,F401 - the tiny Qwen2.5-VL fixture

ROOT = Path(__file__).resolve().parents[1]
REPO = "HuggingFaceTB/SmolVLM-256M-Instruct"

# In a child: huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE when it is imported.
ASK = """
import base64, io, json, sys, numpy as np
from PIL import Image
from pipeline.llm.engine.params import SamplingParams
from pipeline.service.tools import Tool
from studio import hub_progress
from studio.compose import build
from studio.config import parse_config
from studio.plan import make_plan

hub_progress.EVERY_S = 0
config = parse_config(["--data-dir", "data", *sys.argv[1:]])
printed = []
service = build(config, make_plan(config), out=printed.append)
try:
    service.load(Tool.IMAGE_CHAT)
    chat = service.host.loaded(Tool.IMAGE_CHAT)
    picture = np.random.default_rng(0).integers(0, 256, (37, 300, 3), dtype=np.uint8)
    reply = "".join(e.text for e in chat.stream(picture, [{"role": "user", "content": "What is in it?"}],
                                                SamplingParams(max_new_tokens=6, temperature=0)))
    # the same question through /v1, the picture as an image_url part
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from app.openai_api import build_router
    api = FastAPI()
    api.include_router(build_router(service=service, api_key=None, allow_files=False))
    png = io.BytesIO()
    Image.fromarray(picture).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    client = TestClient(api)
    listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
    answer = client.post("/v1/chat/completions", json={"model": listed[-1], "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is in it?"},
                                                  {"type": "image_url", "image_url": {"url": url}}]}]}).json()
    print(json.dumps({"kind": type(chat).__name__, "demo": service.is_demo(Tool.IMAGE_CHAT) or chat.is_demo,
                      "reply": reply, "report": list(service.startup), "printed": printed, "listed": listed,
                      "api": answer, "notice": service.notice(Tool.IMAGE_CHAT),
                      "in_use": service.catalog.in_use()["image chat"]}))
finally:
    service.close()
"""


def _ask(hub_url: str, tmp: Path, *args: str, script: str = ASK) -> dict:
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_CACHE": str(tmp / "hub"), "STUDIO_CACHE": str(tmp / "cache"),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_the_api_reaches_it(got: dict, model_id: str) -> None:
    """/v1 lists image chat under the VLM's id, and an image_url question gets the VLM's own greedy reply."""
    assert got["listed"][-1] == model_id, got["listed"]
    assert got["api"]["model"] == model_id and got["api"]["choices"][0]["message"]["content"] == got["reply"], got["api"]


def test_smolvlm_downloads_on_first_use_and_answers_about_a_picture(folder, tmp_path):  # noqa: F811
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    with serving({REPO: folder}, delay_s=0.0002) as hub:
        first = _ask(hub.url, tmp_path)
    assert first["kind"] == "SmolVLMChatPipeline" and not first["demo"] and first["reply"], first
    assert_the_api_reaches_it(first, REPO)
    assert first["printed"][1] == "Image chat: SmolVLM-256M-Instruct, 0.5 GB, downloads on first use, on the CPU " \
                                  "(its decoder as 8-bit blocks on ONNX Runtime)", first["printed"]
    said = " ".join(first["report"])
    assert f"image chat: downloading {REPO} (0.5 GB)" in said and "downloaded " in said, said
    with serving({}) as empty_hub:  # cached: nothing asked of the hub
        again = _ask(empty_hub.url, tmp_path)
        assert empty_hub.ranges == []
    assert again["kind"] == "SmolVLMChatPipeline" and again["reply"] == first["reply"]
    assert "downloading" not in " ".join(again["report"])
    assert again["printed"][1] == "Image chat: SmolVLM-256M-Instruct on the CPU (its decoder as 8-bit blocks " \
        "on ONNX Runtime)", again["printed"]


CHOICE = """
import json, sys
from studio.config import parse_config
from studio.vlm import vlm_id
print(json.dumps({device: vlm_id(parse_config([]), device) for device in ("cuda", "cpu")}))
"""


def test_qwen_vl_downloads_when_asked_for_answers_and_is_the_gpus_choice_once_cached(qwen_vl_folder, tmp_path):  # noqa: F811
    qwen = "Qwen/Qwen2.5-VL-3B-Instruct"
    with serving({}) as empty_hub:
        assert _ask(empty_hub.url, tmp_path, script=CHOICE) == {"cuda": REPO, "cpu": REPO}  # nothing cached
    with serving({qwen: qwen_vl_folder}, delay_s=0.0002) as hub:
        got = _ask(hub.url, tmp_path, "--vlm", "qwen2.5-vl-3b")
    assert got["kind"] == "QwenVLChatPipeline" and not got["demo"] and got["reply"], got
    assert_the_api_reaches_it(got, qwen)
    said = " ".join(got["report"])
    assert f"image chat: downloading {qwen} (7.5 GB)" in said and "downloaded " in said, said
    assert got["printed"][1] == "Image chat: Qwen2.5-VL-3B-Instruct, 7.5 GB, downloads on first use, on the CPU " \
                                "(float32)", got["printed"]
    with serving({}) as empty_hub:  # cached: `auto` takes it on a GPU, SmolVLM stays the CPU's
        assert _ask(empty_hub.url, tmp_path, script=CHOICE) == {"cuda": qwen, "cpu": REPO}


def test_offline_with_nothing_cached_image_chat_says_its_demo_before_any_upload(tmp_path):
    """The hub out of reach at start-up: the MiniGPT-4 demo is planned at once (no download tried); the first line
    and the tab's banner say so and what one download would bring, and the Models tab names the demo."""
    with socket.socket() as s:  # a port nothing listens on: the hub unreachable
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    got = _ask(closed, tmp_path)
    assert got["kind"] == "ImageChatPipeline" and got["demo"], got
    assert got["printed"][1].startswith("Image chat: a demo MiniGPT-4 with random weights (its answers mean nothing; "
                                        "offline: SmolVLM-256M-Instruct, a 0.5 GB download, answers once online), "), got
    assert "you are offline" in got["notice"] and "SmolVLM-256M-Instruct (0.5 GB)" in got["notice"], got["notice"]
    assert got["in_use"] != REPO and not any("could not download" in line for line in got["report"]), got


def test_a_download_that_fails_after_start_up_runs_the_demo_and_says_what_a_download_gives(tmp_path):
    with serving({}) as empty_hub:  # the hub answers, but has no SmolVLM
        got = _ask(empty_hub.url, tmp_path)
    assert got["kind"] == "ImageChatPipeline" and got["demo"] and got["in_use"] != REPO, got
    assert any(f"could not download {REPO}" in line and "SmolVLM-256M-Instruct (0.5 GB)" in line
               for line in got["report"]), got["report"]
