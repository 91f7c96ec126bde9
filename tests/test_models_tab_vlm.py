"""Image chat's models in the Models tab (issue 42): the default SmolVLM listed as downloading on first use, then
from the Hugging Face cache once Image chat's first use fetched it (from a local hub, tests/hub_server.py); a
Qwen2.5-VL folder in `--models-dir` listed as a VLM with its parameters and size, never "not supported"; Image
chat switched to it from the tab's list, and back to MiniGPT-4 over a listed LLaMA. The rows are the tab's own
(`model_table`), made in a child: huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE when it is imported."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from app.models_tab import count_text  # noqa: E402
from hub_server import serving  # noqa: E402
from pipeline.service.tools import size_text  # noqa: E402
from studio.sizes import weights_size  # noqa: E402
from test_qwen_vl_chat import folder as qwen_vl_folder  # noqa: E402,F401 - the tiny Qwen2.5-VL fixture
from test_smolvlm import folder  # noqa: E402,F401 - the tiny SmolVLM fixture
from test_smolvlm_chat import TEMPLATE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOLVLM = "HuggingFaceTB/SmolVLM-256M-Instruct"

LIST_AND_SWITCH = """
import json, sys
from app.models_tab import SWITCHES, model_table
from pipeline.service.tools import Tool
from studio.compose import build
from studio.config import parse_config
from studio.plan import make_plan

config = parse_config(["--data-dir", "data", "--models-dir", sys.argv[1]])
service = build(config, make_plan(config), out=None)
catalog = service.catalog

def table():
    headers, rows = model_table(catalog.refresh(), catalog.room(), catalog.in_use(), verbose=True)
    return {row[0]: dict(zip(headers, row)) for row in rows}

try:
    out = {"before": table()}
    service.load(Tool.IMAGE_CHAT)  # its first use: SmolVLM downloaded into the hub cache
    out["after"] = table()
    out["choices"] = [e.id for e in catalog.models() if Tool.IMAGE_CHAT in e.tools]  # the tab's picker
    out["switch"] = list(service.switch(Tool.IMAGE_CHAT, sys.argv[2]))
    out["runs"] = type(service.host.loaded(Tool.IMAGE_CHAT)).__name__
    out["switched"] = table()
    out["back"] = list(service.switch(Tool.IMAGE_CHAT, "demo/llama-tiny"))
    out["back_runs"] = type(service.host.loaded(Tool.IMAGE_CHAT)).__name__
    print(json.dumps(out))
finally:
    service.close()
"""


def _params(folder: Path) -> int:
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def test_vlms_are_listed_with_their_size_and_image_chat_switches_to_one(folder, qwen_vl_folder, tmp_path):  # noqa: F811
    smolvlm = tmp_path / "smolvlm"
    shutil.copytree(folder, smolvlm)
    (smolvlm / "chat_template.jinja").write_text(TEMPLATE)
    qwen = tmp_path / "models" / "qwen-vl"
    shutil.copytree(qwen_vl_folder, qwen)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "STUDIO_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    with serving({SMOLVLM: smolvlm}) as hub:
        done = subprocess.run([sys.executable, "-c", LIST_AND_SWITCH, str(qwen.parent), str(qwen)],
                              env={**env, "HF_ENDPOINT": hub.url}, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])

    qwen_row = {"Model": str(qwen), "Kind": "VLM", "Family": "Qwen2.5-VL", "Parameters": count_text(_params(qwen)),
                "On disk": size_text(sum(f.stat().st_size for f in qwen.iterdir())),
                "Runs as": "float32", "Memory": size_text(weights_size(qwen, dtype=torch.float32)), "Fits": "yes",
                "Where": "models folder", "In use by": ""}
    assert got["before"][str(qwen)] == qwen_row
    assert got["before"][SMOLVLM] == {"Model": SMOLVLM, "Kind": "VLM", "Family": "SmolVLM", "Parameters": "",
                                      "On disk": "", "Runs as": "float32", "Memory": "",
                                      "Fits": "in use", "Where": "downloads on first use (0.5 GB)", "In use by": "image chat"}
    downloaded = got["after"][SMOLVLM]
    assert (downloaded["Kind"], downloaded["Where"], downloaded["In use by"]) == ("VLM", "Hugging Face cache",
                                                                                  "image chat"), downloaded
    assert downloaded["Parameters"] == count_text(_params(smolvlm)) and downloaded["On disk"], downloaded
    assert not [row for table in (got["before"], got["after"]) for row in table.values() if row["Kind"] == "other"]
    assert {SMOLVLM, str(qwen)} <= set(got["choices"]), got["choices"]

    assert got["switch"][-1] == f"image chat now runs {qwen}.", got["switch"]
    assert got["runs"] == "QwenVLChatPipeline"
    assert got["switched"][str(qwen)]["In use by"] == "image chat" and got["switched"][SMOLVLM]["In use by"] == ""
    assert got["back"][-1] == "image chat now runs demo/llama-tiny." and got["back_runs"] == "ImageChatPipeline"
