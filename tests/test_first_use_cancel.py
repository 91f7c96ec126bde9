"""A tool's first-use download cancelled (issue 42): Image chat's SmolVLM and Segment's MobileSAM come from a
slow local hub (tests/hub_server.py) while the tool loads as its tab loads it (`StudioService.loading`); the
Models tab's Cancel download (`catalog.cancel_first_use`) stops it within a read, the tool says so in words
(no demo runs in its place), and the next use downloads again, keeping the files already complete. Ctrl+C
during `launch.py --preload`'s download ends the process at once, not after the download."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")

from hub_server import serving  # noqa: E402
from pipeline.sam.model import VARIANTS, Sam  # noqa: E402
from test_smolvlm import folder  # noqa: E402,F401 - the tiny SmolVLM checkpoint fixture
from test_smolvlm_chat import TEMPLATE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOLVLM, MOBILE_SAM = "HuggingFaceTB/SmolVLM-256M-Instruct", "dhkim2810/MobileSAM"
PADDING = "padding.txt"  # a file the download fetches (FILES takes *.txt) and the model never reads
PADDING_MIB = 32
HINT = "Cancel download in the Models tab stops it"  # on every line of the download: the status shows the last

# In a child: huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE when it is imported. Loads argv[1]'s tool twice,
# cancelling the first load's download once it has 1 MiB, as the Models tab's Cancel download does.
LOAD_TWICE = """
import json, re, sys
from pipeline.errors import UserError
from pipeline.service.tools import Tool
from studio import hub_progress
from studio.compose import build, configure_process
from studio.config import parse_config
from studio.plan import make_plan

configure_process()  # huggingface_hub's reads of 1 MiB, as the app starts with
hub_progress.EVERY_S = 0  # every read reported
config = parse_config(["--data-dir", "data"])
service = build(config, make_plan(config), out=None)
tool = Tool(sys.argv[1])
attempts = []
for attempt in ("cancel", "finish"):
    lines, error = [], None
    try:
        for line in service.loading(tool):
            lines.append(line)
            if attempt == "cancel" and (m := re.search(r"downloaded ([0-9.]+) MiB", line)) and float(m[1]) >= 1:
                service.catalog.cancel_first_use()
    except UserError as e:
        error = str(e)
    loaded = service.host.loaded(tool)
    attempts.append({"lines": lines, "error": error, "loaded": type(loaded).__name__ if loaded else None,
                     "demo": loaded.is_demo if loaded else None})
service.close()
print(json.dumps(attempts))
"""


def _env(hub_url: str, tmp: Path) -> dict:
    return {**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_CACHE": str(tmp / "hub"), "STUDIO_CACHE": str(tmp / "cache"),
            "PYTHONPATH": str(ROOT)}


def _load_twice(hub_url: str, tmp: Path, tool: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", LOAD_TWICE, tool], env=_env(hub_url, tmp), capture_output=True,
                          text=True, timeout=600, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _most_downloaded(lines: list[str]) -> float:
    """The most MiB a progress line said were downloaded."""
    return max(float(m[1]) for line in lines if (m := re.search(r"downloaded ([0-9.]+) MiB", line)))


@pytest.fixture
def smolvlm_repo(folder, tmp_path) -> Path:  # noqa: F811
    """The tiny SmolVLM as the hub serves it, with a big file that makes its download take seconds."""
    repo = tmp_path / "smolvlm"
    shutil.copytree(folder, repo)
    (repo / "chat_template.jinja").write_text(TEMPLATE)
    (repo / PADDING).write_bytes(os.urandom(PADDING_MIB << 20))
    return repo


def test_image_chat_download_cancelled_says_so_and_the_next_use_downloads_the_rest(smolvlm_repo, tmp_path):
    with serving({SMOLVLM: smolvlm_repo}, delay_s=0.002) as hub:
        cancelled, finished = _load_twice(hub.url, tmp_path, "image chat")
        fetched = [name for name, _ in hub.ranges]
    assert cancelled["error"] == (f"the download of {SMOLVLM} was cancelled: use Image chat again to fetch what is "
                                  f"still missing (the files already complete are kept)"), cancelled
    assert cancelled["loaded"] is None, cancelled  # not the MiniGPT-4 demo in its place: the next use tries again
    said = "\n".join(cancelled["lines"])
    assert f"downloading {SMOLVLM} (0.5 GB) — {HINT}" in said, said
    assert all(line.endswith(HINT) for line in cancelled["lines"] if "download" in line), said
    # stopped before the file was whole (at once, a read of 1 MiB or two; how many more came in the meantime
    # depends on the machine's speed, so the verdict asks only that it stopped)
    assert _most_downloaded(cancelled["lines"]) < PADDING_MIB, said
    assert finished["error"] is None and finished["loaded"] == "SmolVLMChatPipeline" and not finished["demo"], finished
    assert _most_downloaded(finished["lines"]) >= PADDING_MIB, finished["lines"]
    assert fetched.count(PADDING) == 2 and fetched.count("config.json") == 1, fetched  # complete files kept
    snapshot = next((tmp_path / "hub" / f"models--{SMOLVLM.replace('/', '--')}" / "snapshots").iterdir())
    assert (snapshot / PADDING).read_bytes() == (smolvlm_repo / PADDING).read_bytes()


def test_segment_download_cancelled_says_so_and_the_next_use_downloads_it(tmp_path):
    repo = tmp_path / "mobile-sam"
    repo.mkdir()
    torch.manual_seed(0)
    torch.save(Sam(VARIANTS["mobile_sam"]).state_dict(), repo / "mobile_sam.pt")
    with serving({MOBILE_SAM: repo}, delay_s=0.002) as hub:
        cancelled, finished = _load_twice(hub.url, tmp_path, "segment")
        fetched = [name for name, _ in hub.ranges]
    assert cancelled["error"] == ("the download of mobile_sam was cancelled: use Segment again to fetch what is still "
                                  "missing (the files already complete are kept)"), cancelled
    assert cancelled["loaded"] is None, cancelled  # not the demo SAM in its place
    said = "\n".join(cancelled["lines"])
    assert f"downloading mobile_sam (40 MB) — {HINT}" in said, said
    assert all(line.endswith(HINT) for line in cancelled["lines"] if "download" in line), said
    assert _most_downloaded(cancelled["lines"]) < (repo / "mobile_sam.pt").stat().st_size / 2**20, said  # stopped
    assert finished["error"] is None and finished["loaded"] == "SegmentPipeline" and not finished["demo"], finished
    assert fetched == ["mobile_sam.pt", "mobile_sam.pt"], fetched
    assert (tmp_path / "cache" / "sam" / "mobile_sam.pt").read_bytes() == (repo / "mobile_sam.pt").read_bytes()


def test_ctrl_c_during_a_preload_download_ends_the_app_at_once(smolvlm_repo, tmp_path, studio_cache, qwen2_demo):
    """huggingface_hub downloads a model's files in a thread pool, which an interrupted wait would let finish
    first: here that would take over 20 s. The app starts with SIGINT ignored, as a shell starts a background
    job (before, such an app downloaded, loaded and served: as seen now and then in full runs of this suite)."""
    # the demo chat model, built already (only it: other workers write elsewhere in the shared cache meanwhile)
    shutil.copytree(qwen2_demo, tmp_path / "cache" / qwen2_demo.relative_to(studio_cache))
    with serving({SMOLVLM: smolvlm_repo}, delay_s=0.01) as hub:
        app = subprocess.Popen([sys.executable, "launch.py", "--preload", "--model", "demo/qwen2-tiny", "--device",
                                "cpu", "--data-dir", str(tmp_path / "data"), "--no-browser"],
                               env=_env(hub.url, tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            while PADDING not in [name for name, _ in hub.ranges]:
                assert app.poll() is None, app.stdout.read()
                time.sleep(0.05)
            time.sleep(1)  # into the download
            app.send_signal(signal.SIGINT)
            try:
                out, _ = app.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # say where it was (seen twice in full runs on a busy machine)
                app.kill()
                pytest.fail(f"the app went on 60 s after Ctrl-C; its output:\n{app.communicate()[0][-3000:]}")
        finally:
            app.kill()
    assert app.returncode == 130 and out.rstrip().endswith("[studio] stopped"), out[-2000:]
    blobs = tmp_path / "hub" / f"models--{SMOLVLM.replace('/', '--')}" / "blobs"
    assert not [b for b in blobs.iterdir() if b.stat().st_size == PADDING_MIB << 20]  # it did not go on


def test_cancel_with_no_download_running_says_so_and_leaves_the_next_download_alone():
    """The Models tab's Cancel download with nothing running: False (the tab says so); a download that
    starts after it is not cancelled by it."""
    from studio.hub_progress import FirstUseDownload

    first_use = FirstUseDownload()
    assert first_use.stop() is False and not first_use.cancel.is_set()
    with first_use.running() as cancel:
        assert not cancel.is_set()
        assert first_use.stop() is True and cancel.is_set()  # the download's progress sees it at its next read
    assert first_use.stop() is False
    with first_use.running() as cancel:
        assert not cancel.is_set()  # a new download starts uncancelled
