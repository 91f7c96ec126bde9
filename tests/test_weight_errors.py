"""Unreadable weight files end in one `UserError` naming the file, in every loader and in `launch.py`."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, free_port
from pipeline.errors import UserError
from pipeline.files import atomic_folder, atomic_write
from pipeline.llm.model.loading import load_decoder
from pipeline.minigpt4.weights import build_demo, load_vision_folder
from pipeline.sam.model import load_sam
from pipeline.sam.weights import resolve_sam
from pipeline.weights_io import read_weight_file

JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(range(256)) * 8
TRUNCATED, GARBAGE = "truncated or corrupt", "not a"


def truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def spoil(path, how: str) -> None:
    truncate(path) if how == TRUNCATED else path.write_bytes(JPEG)


@pytest.fixture
def llm_copy(qwen2_demo, tmp_path):
    return shutil.copytree(qwen2_demo, tmp_path / "qwen2")


@pytest.mark.parametrize("how", [TRUNCATED, GARBAGE])
def test_llm_loader(llm_copy, how):
    spoil(llm_copy / "model.safetensors", how)
    with pytest.raises(UserError, match=f"model.safetensors: it is {how}"):
        load_decoder(llm_copy)


@pytest.mark.parametrize("how", [TRUNCATED, GARBAGE])
def test_sam_loader(studio_cache, tmp_path, how):
    path = tmp_path / "sam.pth"
    shutil.copy(resolve_sam("demo/sam-tiny", studio_cache), path)
    spoil(path, how)
    with pytest.raises(UserError, match=f"cannot read SAM checkpoint .*sam.pth: it is {how}"):
        load_sam(path)


@pytest.mark.parametrize("name", ["eva_vit_g.pth", "blip2_pretrained_flant5xxl.pth", "prerained_minigpt4_7b.pth"])
@pytest.mark.parametrize("how", [TRUNCATED, GARBAGE])
def test_minigpt4_loader(tmp_path, name, how):
    build_demo(tmp_path, llm_width=64)
    spoil(tmp_path / name, how)
    with pytest.raises(UserError, match=f"{name}: it is {how}"):
        load_vision_folder(tmp_path / "prerained_minigpt4_7b.pth", tmp_path)


class NotATensor:
    pass


def test_missing_folder_code_and_wrong_contents_are_told_apart(tmp_path):
    torch.save({"w": NotATensor()}, tmp_path / "code.pth")
    torch.save({"w": torch.zeros(2), "epoch": 3}, tmp_path / "training.pth")
    torch.save([torch.zeros(2)], tmp_path / "list.pth")
    (tmp_path / "lfs.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "folder.pth").mkdir()
    cases = {"missing.pth": "does not exist", "folder.pth": "is a folder", "code.pth": "NotATensor.*could run code",
             "training.pth": "'epoch' is not a tensor", "list.pth": "holds a list", "lfs.safetensors": "Git LFS",
             "empty.bin": "truncated"}
    for name, message in cases.items():
        with pytest.raises(UserError, match=f"cannot read weights file {re.escape(str(tmp_path / name))}: .*{message}"):
            read_weight_file(tmp_path / name)


def test_weight_files_keep_filters_and_unwraps(tmp_path):
    torch.save({"model": {"a.w": torch.ones(2), "b.w": torch.zeros(1)}}, tmp_path / "wrapped.pth")
    assert list(read_weight_file(tmp_path / "wrapped.pth", keep=lambda k: k.startswith("a."))) == ["a.w"]
    torch.save({"a.w": torch.ones(2)}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    assert torch.equal(read_weight_file(tmp_path / "legacy.pth")["a.w"], torch.ones(2))  # no mmap for old files


def test_atomic_writes_leave_nothing_behind(tmp_path):
    atomic_write(tmp_path / "sub" / "key", "secret", mode=0o600)
    assert (tmp_path / "sub" / "key").read_text() == "secret"
    assert (tmp_path / "sub" / "key").stat().st_mode & 0o777 == 0o600
    with atomic_folder(tmp_path / "out") as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "out") as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError
    assert (tmp_path / "out" / "a").read_text() == "1"  # the failed write left the old folder as it was
    with atomic_folder(tmp_path / "out") as tmp:
        (tmp / "b").write_text("3")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["b"]  # replaced, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "sub"] and os.listdir(tmp_path / "sub") == ["key"]


def test_launch_with_truncated_weights_is_one_line_and_exit_code_2(llm_copy, tmp_path):
    truncate(llm_copy / "model.safetensors")
    env = {**os.environ, "STUDIO_CACHE": str(tmp_path / "cache"), "GRADIO_ANALYTICS_ENABLED": "False"}
    run = subprocess.run([sys.executable, "launch.py", "--weights", str(llm_copy), "--port", str(free_port())],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert len(errors) == 1 and "model.safetensors: it is truncated or corrupt" in errors[0], run.stderr
