"""Segment's default model, MobileSAM, downloaded on first use from a local hub (tests/hub_server.py) in the
official `mobile_sam.pt` layout: progress lines, a connection dropped halfway resumed from the bytes it had
(HTTP Range), the file loaded as MobileSAM and cached; offline with nothing cached the demo SAM runs and the
start-up report says what one download would give."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from hub_server import serving
from pipeline.sam.model import VARIANTS, Sam

ROOT = Path(__file__).resolve().parents[1]

# In a child: huggingface_hub reads HF_ENDPOINT when it is imported.
LOAD_SEGMENT = """
import json, numpy as np
from pipeline.service.tools import Tool
from studio import hub_progress
from studio.compose import build
from studio.config import parse_config
from studio.plan import make_plan

hub_progress.EVERY_S = 0
config = parse_config(["--data-dir", "data"])
printed = []
service = build(config, make_plan(config), out=printed.append)
def sam_entries():
    return {e.id: e.source for e in service.catalog.refresh() if e.kind == "SAM"}
try:
    before = sam_entries()
    service.load(Tool.SEGMENT)
    segment = service.host.loaded(Tool.SEGMENT)
    segment.set_image(np.zeros((40, 60, 3), dtype=np.uint8))
    print(json.dumps({"demo": segment.is_demo, "description": segment.description, "before": before,
                      "after": sam_entries(), "notice": service.notice(Tool.SEGMENT),
                      "in_use": service.catalog.in_use()["segment"],
                      "report": list(service.startup), "printed": printed}))
finally:
    service.close()
"""


def _load_segment(hub_url: str, cache: Path, cwd: Path, **env: str) -> dict:
    env = {**os.environ, "HF_ENDPOINT": hub_url, "STUDIO_CACHE": str(cache), "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-c", LOAD_SEGMENT], env=env, capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_mobile_sam_downloads_on_first_use_resumes_a_dropped_connection_and_is_cached(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    torch.manual_seed(0)
    torch.save(Sam(VARIANTS["mobile_sam"]).state_dict(), repo / "mobile_sam.pt")
    cache = tmp_path / "cache"
    with serving({"dhkim2810/MobileSAM": repo}, delay_s=0.0005, drop_once=("mobile_sam.pt",)) as hub:
        first = _load_segment(hub.url, cache, tmp_path)
        resumed = [r for f, r in hub.ranges if f == "mobile_sam.pt" and r]
    assert not first["demo"] and first["description"].startswith("MobileSAM (TinyViT)"), first
    assert first["before"]["mobile_sam"] == "downloads on first use (40 MB)" and first["after"]["mobile_sam"] == "cache"
    said = " ".join(first["report"])
    assert "segment: downloading mobile_sam (40 MB)" in said and "downloaded " in said, said
    assert resumed and resumed[0].startswith("bytes=") and not resumed[0].startswith("bytes=0-"), hub.ranges
    assert (cache / "sam" / "mobile_sam.pt").read_bytes() == (repo / "mobile_sam.pt").read_bytes()
    with serving({}) as empty_hub:  # cached: nothing asked of the hub
        again = _load_segment(empty_hub.url, cache, tmp_path)
        assert empty_hub.ranges == []
    assert not again["demo"] and "downloading" not in " ".join(again["report"])


def test_offline_with_nothing_cached_segment_says_its_demo_before_any_click(tmp_path):
    """The hub out of reach at start-up: the plan takes the demo SAM at once (no download tried), and the first
    line, the tab's banner and the Models tab all say so, with advice that works offline."""
    with socket.socket() as s:  # a port nothing listens on: the hub unreachable
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    got = _load_segment(closed, tmp_path / "cache", tmp_path)
    assert got["demo"] and got["in_use"] == "demo/sam-tiny", got
    assert got["printed"][2] == ("Segment: a demo SAM with random weights (its masks mean nothing; offline: MobileSAM, a "
                                 "40 MB download, gives real masks once online, or --sam /path/to/mobile_sam.pt), on "
                                 "the CPU (float32)"), got["printed"]
    assert "you are offline" in got["notice"] and "--sam /path/to/mobile_sam.pt" in got["notice"] \
        and "https://github.com/ChaoningZhang/MobileSAM/raw/master/weights/mobile_sam.pt" in got["notice"], got["notice"]
    assert not any("downloading" in line or "could not download" in line for line in got["report"]), got["report"]


def test_a_download_that_fails_after_start_up_runs_the_demo_and_the_models_tab_says_so(tmp_path):
    """The hub answers but has no MobileSAM: the download fails on first use, the demo runs, and the Models tab
    names the demo as what Segment uses, not the model that failed."""
    with serving({}) as empty_hub:
        got = _load_segment(empty_hub.url, tmp_path / "cache", tmp_path)
    assert got["demo"] and got["in_use"] == "demo/sam-tiny", got
    assert any("could not download mobile_sam" in line and "MobileSAM (40 MB, one download)" in line
               for line in got["report"]), got["report"]


def test_mobile_sam_in_the_hugging_face_cache_is_used_offline(tmp_path):
    """Fetched into the hub's cache as `huggingface-cli download dhkim2810/MobileSAM` fetches it (a child process
    that reads HF_ENDPOINT), then the app offline: that file runs, nothing is downloaded, and the Models tab
    lists it as cached."""
    repo, hub_cache = tmp_path / "repo", tmp_path / "hf"
    repo.mkdir()
    torch.manual_seed(1)
    torch.save(Sam(VARIANTS["mobile_sam"]).state_dict(), repo / "mobile_sam.pt")
    fetch = "from huggingface_hub import hf_hub_download; print(hf_hub_download('dhkim2810/MobileSAM', 'mobile_sam.pt'))"
    with serving({"dhkim2810/MobileSAM": repo}) as hub:
        fetched = subprocess.run([sys.executable, "-c", fetch], capture_output=True, text=True, timeout=300,
                                 env={**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(hub_cache)})
    assert fetched.returncode == 0 and Path(fetched.stdout.strip()).is_relative_to(hub_cache), fetched.stderr[-2000:]
    got = _load_segment("http://127.0.0.1:9", tmp_path / "cache", tmp_path, HF_HUB_CACHE=str(hub_cache),
                        HF_HUB_OFFLINE="1")
    assert not got["demo"] and got["description"].startswith("MobileSAM (TinyViT)"), got
    assert got["before"]["mobile_sam"] == "cache" and "downloading" not in " ".join(got["report"]), got
    assert not (tmp_path / "cache" / "sam" / "mobile_sam.pt").exists()  # used where it is, not copied
