"""The engine cache with real ONNX Runtime builds (MiniGPT-4's tiny vision side builds in ~2 s):
changed weights, a damaged engine file, an engine that no longer loads and `--rebuild` each lead to
a rebuild, with the reason reported; a failed build falls back to torch and leaves nothing behind."""

import dataclasses
import hashlib
import json
import time

import pytest
import torch

from engine_builder import build as engine_build
from engine_builder.build import EngineOptions
from studio.startup_report import StartupReport
from engine_builder.cache import EngineCache
from pipeline.minigpt4.engine import SessionVisionEncoder
from studio.backends import vision_encoder
from pipeline.minigpt4.engine import TorchVisionEncoder
from pipeline.minigpt4.weights import build_demo, load_vision_folder


@pytest.fixture
def weights(tmp_path):
    folder = tmp_path / "vision"
    folder.mkdir()
    build_demo(folder, llm_width=64)
    return folder / "prerained_minigpt4_7b.pth", folder


def launch(weights, engine_dir, rebuild=False) -> tuple[object, list[str]]:
    """What a launch does for image chat's vision engine: the engine and the start-up report."""
    ckpt, folder = weights
    options = EngineOptions(EngineCache(engine_dir, rebuild), StartupReport(out=None))
    encoder = vision_encoder(load_vision_folder(ckpt, folder), "onnxruntime", [ckpt, folder], options)
    return encoder, options.report.lines


def check_matches_torch(encoder, weights) -> None:
    assert isinstance(encoder, SessionVisionEncoder)
    pixels = torch.randn(1, 3, 224, 224)
    reference = TorchVisionEncoder(load_vision_folder(*weights)).encode(pixels)
    assert torch.allclose(encoder.encode(pixels), reference, rtol=1e-4, atol=1e-5)


def test_built_once_then_loaded(weights, tmp_path):
    encoder, report = launch(weights, tmp_path / "engines")
    assert "building (not built yet)" in report[0] and " built in " in report[-1] and "verified (" in report[-1]
    check_matches_torch(encoder, weights)
    encoder, report = launch(weights, tmp_path / "engines")
    assert len(report) == 1 and "loaded from cache in" in report[0]
    check_matches_torch(encoder, weights)


def test_changed_weights_rebuild(weights, tmp_path):
    launch(weights, tmp_path / "engines")
    ckpt, folder = weights
    state = torch.load(ckpt, weights_only=True)
    state["model"]["llama_proj.bias"] += 1.0
    torch.save(state, ckpt)
    encoder, report = launch(weights, tmp_path / "engines")
    assert "building (built for the weights changed)" in report[0], report
    check_matches_torch(encoder, weights)  # the new weights, not the old engine


def test_a_damaged_engine_file_is_rebuilt(weights, tmp_path):
    launch(weights, tmp_path / "engines")
    (data,) = (tmp_path / "engines").glob("minigpt4_vision-*/engine.onnx.data")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte: still loads, computes garbage; the checksum catches it
    data.write_bytes(bytes(raw))
    encoder, report = launch(weights, tmp_path / "engines")
    assert "building (engine.onnx.data is damaged (checksum mismatch))" in report[0], report
    check_matches_torch(encoder, weights)


def test_an_engine_that_no_longer_loads_is_rebuilt(weights, tmp_path):
    """A file whose checksum matches but which the runtime rejects (as after a runtime upgrade in place)."""
    launch(weights, tmp_path / "engines")
    (folder,) = [p for p in (tmp_path / "engines").glob("minigpt4_vision-*") if p.is_dir()]
    (folder / "engine.onnx").write_bytes(b"not a model")
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["engine.onnx"] = {"bytes": 11, "sha256": hashlib.sha256(b"not a model").hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))
    encoder, report = launch(weights, tmp_path / "engines")
    assert "building (the cached engine failed to load" in report[0], report
    check_matches_torch(encoder, weights)


def test_rebuild_flag_builds_again(weights, tmp_path):
    launch(weights, tmp_path / "engines")
    _, report = launch(weights, tmp_path / "engines", rebuild=True)
    assert "building (--rebuild)" in report[0]


def test_a_failed_build_falls_back_to_torch_and_is_not_retried_until_rebuild(weights, tmp_path, monkeypatch):
    """A failed build leaves nothing, and the next launch neither exports nor builds again (the failure
    is remembered with the engine's key) until `--rebuild`."""
    builds, exports = [], []

    def disk_full(*args):
        builds.append(args)
        raise OSError(28, "No space left on device")

    failing = dataclasses.replace(engine_build.RUNTIMES["onnxruntime"], build=disk_full)
    monkeypatch.setitem(engine_build.RUNTIMES, "onnxruntime", failing)
    real_export = engine_build.export_onnx
    monkeypatch.setattr(engine_build, "export_onnx", lambda *a: exports.append(a) or real_export(*a))
    start = time.perf_counter()
    encoder, report = launch(weights, tmp_path / "engines")
    first_s = time.perf_counter() - start
    assert isinstance(encoder, TorchVisionEncoder)
    assert "the onnxruntime vision engine failed (OSError: [Errno 28] No space left on device); " \
           "running on torch instead" in report[-1], report
    assert not [p for p in (tmp_path / "engines").iterdir() if p.is_dir()]  # no partial engine, no temporary folder
    assert (len(exports), len(builds)) == (1, 1)
    start = time.perf_counter()
    encoder, report = launch(weights, tmp_path / "engines")
    again_s = time.perf_counter() - start
    assert isinstance(encoder, TorchVisionEncoder) and (len(exports), len(builds)) == (1, 1)  # no export, no build
    assert not any("building" in line for line in report), report
    assert "its build failed before (OSError: [Errno 28] No space left on device); not retried until " \
           "--rebuild" in report[-1], report
    assert again_s < first_s / 2, (again_s, first_s)  # the export alone takes longer
    _, report = launch(weights, tmp_path / "engines", rebuild=True)
    assert "building (--rebuild)" in report[0] and len(builds) == 2


def tamper(engine_dir, scale: float = 3.0) -> None:
    """Scale the largest initializer of the cached MiniGPT-4 graph, then rewrite the metadata's sizes,
    checksums and stamps to match: an engine that loads, passes the cache's checks, and computes wrong."""
    import onnx
    from onnx import numpy_helper

    from engine_builder.cache import _stamp
    from pipeline.files import file_sha256

    (folder,) = [p for p in engine_dir.glob("minigpt4_vision-*") if p.is_dir()]
    model = onnx.load(str(folder / "engine.onnx"))
    init = max(model.graph.initializer, key=lambda t: numpy_helper.to_array(t).size)
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * scale, init.name))
    onnx.save(model, str(folder / "engine.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="engine.onnx.data")
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p), "stamp": _stamp(p)}
                     for p in sorted(folder.iterdir()) if p.name != "meta.json"}
    (folder / "meta.json").write_text(json.dumps(meta))


def test_an_engine_that_computes_wrong_is_refused_reported_and_stays_refused(weights, tmp_path, monkeypatch):
    """The trust gate: a new engine is checked against torch on probe inputs and used only if it
    passes; one that loads but computes wrong serves nothing, is reported with the check's numbers (in
    the start-up report the UI shows, and in `--check`), and stays refused across restarts until
    `--rebuild` builds a correct one."""
    from engine_builder.build import engine_status
    from engine_builder.onnx_export import minigpt4_graph

    engines = tmp_path / "engines"
    encoder, report = launch(weights, engines)
    assert isinstance(encoder, SessionVisionEncoder) and "verified (minigpt4_vision against torch" in report[-1]
    check_matches_torch(encoder, weights)
    tamper(engines)
    encoder, report = launch(weights, engines)
    assert isinstance(encoder, TorchVisionEncoder), report
    refused = [line for line in report if "refused (minigpt4_vision against torch on probe inputs: " in line]
    assert refused and "query_embeddings error" in refused[0] and "running on torch instead" in report[-1], report
    ckpt, folder = weights
    graphs = (minigpt4_graph(load_vision_folder(ckpt, folder).config),)
    status = engine_status(graphs, [ckpt, folder], "onnxruntime", "float32", EngineCache(engines))
    assert "refused (minigpt4_vision against torch" in status[0], status
    checks = []
    real_check = engine_build.check_engine
    monkeypatch.setattr(engine_build, "check_engine", lambda *a: checks.append(a) or real_check(*a))
    encoder, report = launch(weights, engines)  # a restart: the verdict holds without checking again
    assert isinstance(encoder, TorchVisionEncoder) and not checks
    assert "not used until --rebuild" in report[-1], report
    encoder, report = launch(weights, engines, rebuild=True)
    assert len(checks) == 1 and "verified (" in report[-1]
    check_matches_torch(encoder, weights)
