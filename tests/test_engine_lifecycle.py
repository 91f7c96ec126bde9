"""The engine lifecycle through `launch.py`: engines built on the first start and loaded on the
second, answering exactly like the torch backend; two launches racing build once; a launch killed
mid-build leaves nothing a later launch loads; `--check` says what would run and whether it is cached."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, TEST_MODEL, launched

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import handle_file  # noqa: E402

from test_app_e2e import text_of  # noqa: E402

PHOTO = "assets/examples/street.jpg"
SAMPLING = (0.7, 0.9, 40, 1.05, 16, 7)  # temperature, top-p, top-k, repetition penalty, max new tokens, seed
COMPONENTS = ("sam_image_encoder", "sam_mask_decoder", "minigpt4_vision")
ORT = ("--backend", "onnxruntime")
DEMOS = ("--sam", "demo/sam-tiny", "--vlm", "minigpt4")  # the models whose engines these tests build, offline


def answers(url: str) -> dict:
    """A segmentation click, an image question, and the start-up report, through the public API."""
    client = gradio_client.Client(url, verbose=False)
    mask_path, info = client.predict(handle_file(PHOTO), "[[120, 80, 1], [300, 200, 0]]", "", True,
                                     api_name="/segment")
    job = client.submit(handle_file(PHOTO), "What is in this picture?", [], *SAMPLING, api_name="/image_chat")
    history, _ = list(job)[-1]
    return {"mask": np.array(Image.open(mask_path)) > 0, "scores": json.loads(info)["scores"],
            "answer": text_of(history[-1]), "startup": json.loads(client.predict(api_name="/engine_status"))["startup"]}


def lines_about(report: list[str], component: str) -> list[str]:
    return [line for line in report if f"{component} engine" in line]


def test_engines_are_built_on_the_first_launch_and_loaded_on_the_second(tmp_path):
    cache, engines = tmp_path / "cache", tmp_path / "engines"
    with launched(tmp_path / "torch.log", cache, "--backend", "torch") as (url, *_):
        reference = answers(url)
    assert not any("engine (" in line for line in reference["startup"])
    runs = []
    for name in ("first", "second"):
        with launched(tmp_path / f"{name}.log", cache, *ORT, *DEMOS, "--engine-dir", str(engines)) as (url, log, *_):
            runs.append(answers(url))
    first, second = runs
    for component in COMPONENTS:
        built = lines_about(first["startup"], component)
        assert "building (not built yet)" in built[0] and " built in " in built[-1], built
        assert "checking it against torch" in built[1] and "verified (" in built[-1], built
        loaded = lines_about(second["startup"], component)
        assert len(loaded) == 1 and "loaded from cache in" in loaded[0] and "verified (" in loaded[0], loaded
    assert "segment: onnxruntime (asked for)" in first["startup"]
    for run in runs:  # the same masks and answer as the torch backend
        assert run["answer"] == reference["answer"] and run["answer"]
        assert np.allclose(run["scores"], reference["scores"], atol=1e-4)
        assert (run["mask"] == reference["mask"]).mean() > 0.9999 and run["mask"].any()


def build_engines(tmp_path, name: str, cache, engines) -> subprocess.Popen:
    """`launch.py --build-engines` (load every tool, building missing engines, then exit) in the background."""
    env = {**os.environ, "STUDIO_CACHE": str(cache), "GRADIO_ANALYTICS_ENABLED": "False"}
    with open(tmp_path / f"{name}.log", "w") as out:
        return subprocess.Popen([sys.executable, "launch.py", "--build-engines", "--verbose", "--model", TEST_MODEL, *ORT,
                                 *DEMOS, "--engine-dir", str(engines)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def test_two_launches_racing_build_each_engine_once(tmp_path):
    cache, engines = tmp_path / "cache", tmp_path / "engines"
    racers = [build_engines(tmp_path, f"racer{i}", cache, engines) for i in range(2)]
    assert [p.wait(timeout=300) for p in racers] == [0, 0]
    logs = [(tmp_path / f"racer{i}.log").read_text() for i in range(2)]
    lines = [line for log in logs for line in log.splitlines() if line.startswith("[studio]")]
    for component in COMPONENTS:
        builds = [line for line in lines_about(lines, component) if "building (" in line]
        loads = [line for line in lines_about(lines, component) if "loaded from cache" in line]
        assert (len(builds), len(loads)) == (1, 1), (component, logs)


def test_a_launch_killed_mid_build_leaves_nothing_that_is_later_loaded(tmp_path):
    cache, engines = tmp_path / "cache", tmp_path / "engines"
    victim = build_engines(tmp_path, "victim", cache, engines)
    deadline = time.time() + 120
    while not list(engines.glob("sam_image_encoder-onnxruntime-*.*")):  # its temporary folder: the build is on
        assert victim.poll() is None and time.time() < deadline, (tmp_path / "victim.log").read_text()
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    slots = [p for p in engines.iterdir() if p.is_dir() and "." not in p.name]
    assert not any(p.name.startswith("sam_image_encoder") for p in slots)  # nothing complete-looking was left
    again = build_engines(tmp_path, "again", cache, engines)
    assert again.wait(timeout=300) == 0
    log = (tmp_path / "again.log").read_text().splitlines()
    assert any("building (not built yet)" in line for line in lines_about(log, "sam_image_encoder")), log
    assert not [p for p in engines.iterdir() if p.is_dir() and "." in p.name]  # the leftovers were removed


def test_check_reports_backends_and_engines_not_built_yet_and_makes_nothing(tmp_path):
    env = {**os.environ, "STUDIO_CACHE": str(tmp_path / "cache")}
    engines = tmp_path / "engines"

    def check(*args: str) -> str:
        done = subprocess.run([sys.executable, "launch.py", "--check", *args, *DEMOS, "--engine-dir", str(engines)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    out = check("--backend", "auto")
    # no GPU and no TensorRT here: auto says what it chose instead, and why
    assert ("segment: torch (eager on the CPU, faster there than ONNX Runtime's engines, instead of TensorRT: "
            "no CUDA GPU)") in out
    assert "chat: torch (instead of TensorRT-LLM: no CUDA GPU)" in out
    assert "engine" not in out.replace("ONNX Runtime's engines", "")  # torch everywhere: no engines to build
    out = check(*ORT)
    assert "image chat engine: will be built once the weights are there" in out  # --check makes nothing
    assert "segment: torch (asked for)" in check(*ORT, "--segment-backend", "torch")
    assert not engines.exists() or not any(engines.iterdir())
    # what --check says once they are built: test_offline_check_after_building_reports_the_engines_the_tools_will_run


def test_selftest_builds_and_checks_every_engine(tmp_path):
    """The self-test users with TensorRT run, here on ONNX Runtime: one OK line per engine, exit 0."""
    env = {**os.environ, "STUDIO_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "studio.selftest", *ORT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] and line.split()[0] in COMPONENTS]
    assert [(r[0], r[1]) for r in rows] == [(c, "onnxruntime") for c in COMPONENTS]
    assert all("OK" in r for r in rows)
    done = subprocess.run([sys.executable, "-m", "studio.selftest"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "tensorrt cannot run here: no CUDA GPU" in done.stdout


def test_offline_check_after_building_reports_the_engines_the_tools_will_run(tmp_path):
    """Offline with nothing downloaded, `--build-engines` builds the demos' engines that Segment and Image chat
    fall back to, and `--check` right after reports those engines and their verdicts, not "will be built"."""
    env = {**os.environ, "STUDIO_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "GRADIO_ANALYTICS_ENABLED": "False"}
    argv = [sys.executable, "launch.py", "--model", TEST_MODEL, *ORT]
    built = subprocess.run([*argv, "--build-engines"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    checked = subprocess.run([*argv, "--check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = checked.stdout.splitlines()
    assert checked.returncode == 0 and not any("will be built" in line for line in lines), checked.stdout
    for tool, component in (("segment engines", "sam_image_encoder"), ("segment engines", "sam_mask_decoder"),
                            ("image chat engine", "minigpt4_vision")):
        assert any(line.startswith(f"  - {tool}: {component}: cached in ") and ", verified (" in line
                   for line in lines), (component, checked.stdout)
    assert any("segment model: the demo SAM" in line and "HF_HUB_OFFLINE is set" in line for line in lines), lines
