"""Downloading a model from the hub through the catalog, as the Models tab does, against a local hub
(tests/hub_server.py): Cancel takes effect within one read, not after the client's default 10 MiB, and
a second download fetches only what the cancelled one had not completed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hub_server import serving

ROOT = Path(__file__).resolve().parents[1]

# Run in a child: huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE when it is imported.
DOWNLOAD = """
import json, sys, tempfile, threading
from pathlib import Path
from pipeline.errors import UserError
from studio import hub_progress
from studio.compose import configure_process
from studio.config import StudioConfig
from studio.model_files import ModelFiles
from studio.model_finder import ModelFinder

configure_process()  # huggingface_hub's reads of 1 MiB, as the app starts with
hub_progress.EVERY_S = 0  # every read reported
catalog = ModelFiles(ModelFinder(StudioConfig(), "float32", "cpu", None, Path(tempfile.mkdtemp())), lambda: {},
                     print)
said, cancel = [], threading.Event()
def say(line):
    said.append(line)
    if sys.argv[1] == "cancel" and not line.startswith("downloaded 0.0 MiB"):  # past config.json
        cancel.set()
try:
    catalog.download("studio-test/big", say, cancel)
    print(json.dumps({"said": said, "error": None}))
except UserError as e:
    print(json.dumps({"said": said, "error": str(e)}))
"""


def _download(hub_url: str, cache: Path, mode: str) -> dict:
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", DOWNLOAD, mode], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cancel_stops_within_one_read_and_the_next_download_fetches_only_the_rest(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (repo / "model.safetensors").write_bytes(os.urandom(48 << 20))
    cache = tmp_path / "hf-cache"
    with serving({"studio-test/big": repo}, delay_s=0.002) as hub:
        cancelled = _download(hub.url, cache, "cancel")
        assert cancelled["error"].startswith("the download of studio-test/big was cancelled"), cancelled
        weights = [line for line in cancelled["said"] if not line.startswith("downloaded 0.0 MiB")]
        assert len(weights) == 1 and weights[0].startswith("downloaded 1.0 MiB of 48.0 MiB"), cancelled["said"]
        blobs = list((cache / "models--studio-test--big" / "blobs").iterdir())
        assert not [b for b in blobs if b.stat().st_size == 48 << 20 and not b.name.endswith(".incomplete")]

        again = _download(hub.url, cache, "finish")
        assert again["error"] is None, again
        assert [name for name, _ in hub.ranges].count("config.json") == 1  # kept from the cancelled one
    snapshot = next((cache / "models--studio-test--big" / "snapshots").iterdir())
    assert (snapshot / "model.safetensors").read_bytes() == (repo / "model.safetensors").read_bytes()
