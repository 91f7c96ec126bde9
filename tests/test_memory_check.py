"""A model that does not fit this machine's free memory is refused in one line before it loads (issue 50, item 3):
what it needs, what is free, and what would fit (a shorter --context where the weights fit, else a smaller file).
On the real default model (SmolLM2-135M's GGUF, float32 weights on the CPU: 0.54 GB)."""

import shutil

import pytest
import torch

from pipeline.errors import UserError
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.weights.checkpoint import read_config
from pipeline.models import locate
from studio.backends import load_language_model
from studio.memory_fit import HEADROOM_BYTES, check_memory, weight_bytes
from test_gguf import cache  # noqa: F401  (the test cache for `locate`)

SMOLLM2 = "builtin/smollm2-135m-instruct"


def test_a_model_that_does_not_fit_is_refused_with_what_would(cache):  # noqa: F811
    config = read_config(locate(SMOLLM2).path)
    weights = weight_bytes(config, "none", torch.float32)
    full = KVCache.row_bytes(config, 8193, torch.float32)
    check_memory("smollm2", config, "none", torch.float32, 8192, weights + full + HEADROOM_BYTES)  # fits: no error
    short = KVCache.row_bytes(config, 2049, torch.float32)
    with pytest.raises(UserError) as refused:  # the weights fit, an 8k conversation does not, a 2k one does
        check_memory("smollm2", config, "none", torch.float32, 8192, weights + short + HEADROOM_BYTES)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(
        f"smollm2 needs {(weights + full) / 1e9:.1f} GB of memory here ({weights / 1e9:.1f} GB of float32 weights and "
        f"{full / 1e9:.1f} GB for a 8192-token conversation); ")
    assert message.endswith("GB are free: close programs or use --context 2048"), message
    with pytest.raises(UserError, match=r"0\.1 GB are free: close programs, or use a smaller model \(a 4-bit GGUF"):
        check_memory("smollm2", config, "none", torch.float32, 8192, 100 << 20)
    # its blocks on ONNX Runtime take 1.9× the file there (measured), not the file's size: that is what is asked for
    file, small = next(locate(SMOLLM2).path.glob("*.gguf")).stat().st_size, KVCache.row_bytes(config, 513, torch.float32)
    check_memory("smollm2", config, "gguf", torch.float32, 512, int(1.9 * file) + small + HEADROOM_BYTES)
    with pytest.raises(UserError, match=r"GB of Q4_1 \(on ONNX Runtime\) weights"):
        check_memory("smollm2", config, "gguf", torch.float32, 512, int(1.2 * file) + small + HEADROOM_BYTES)


def test_the_check_comes_before_the_weights_are_read(cache, tmp_path, monkeypatch):  # noqa: F811
    """A folder whose weight file is cut short, on a machine with 200 MB free: the refusal is the memory's (nothing
    was read); with plenty free, the damaged file's."""
    import studio.backends

    folder = tmp_path / "smollm2"
    shutil.copytree(locate(SMOLLM2).path, folder, symlinks=False)
    gguf = next(folder.glob("*.gguf"))
    gguf.write_bytes(gguf.read_bytes()[:4096])
    monkeypatch.setattr(studio.backends, "available_memory", lambda: 200 << 20)
    with pytest.raises(UserError, match=r"^smollm2 needs 0\.\d GB of memory here .* 0\.2 GB are free: close programs"):
        load_language_model(folder, "smollm2", device="cpu", max_context=8192)
    monkeypatch.setattr(studio.backends, "available_memory", lambda: 64 << 30)
    with pytest.raises(UserError, match="a damaged file"):
        load_language_model(folder, "smollm2", device="cpu", max_context=8192)
