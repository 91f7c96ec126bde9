"""Triton's installation key kept between launches (`plugins/triton_cache.py`): a process whose Triton files are
unchanged takes the key kept in Triton's cache folder without hashing them, and gets the very key Triton makes;
a changed file or a damaged record makes it again. Each case runs in a fresh process, as a launch does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

from plugins.triton_cache import KEY_RECORD, files_digest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = """
import json, sys
import triton.runtime.autotuner as autotuner
import triton.runtime.cache as cache
from plugins.triton_cache import remember_key
real = cache.triton_key
if sys.argv[1] == "refuse":  # this process must not hash Triton's files
    def refuse():
        raise AssertionError("Triton's files were hashed")
    cache.triton_key = autotuner.triton_key = refuse
key = remember_key()
print(json.dumps({"key": key, "cache": key and cache.triton_key(), "autotuner": key and autotuner.triton_key(),
                  "made": real() if sys.argv[1] == "hash" else None}))
"""


def launch(cache: Path, mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", LAUNCH, mode], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_launch_takes_the_kept_key_without_hashing_and_a_change_makes_it_again(tmp_path):
    first = launch(tmp_path, "hash")
    assert first["key"] == first["made"] == first["cache"] == first["autotuner"]  # Triton's own, in every module
    record = tmp_path / KEY_RECORD
    assert json.loads(record.read_text())["key"] == first["key"]
    second = launch(tmp_path, "refuse")
    assert second["key"] == second["cache"] == second["autotuner"] == first["key"]  # taken, not made
    kept = json.loads(record.read_text())
    record.write_text(json.dumps({**kept, "files": kept["files"] + "-a file changed"}))
    assert launch(tmp_path, "refuse")["key"] is None  # it must hash: refused here, so Triton hashes itself later
    again = launch(tmp_path, "hash")
    assert again["key"] == again["made"] == first["key"] and json.loads(record.read_text()) == kept
    record.write_text("{damaged")
    assert launch(tmp_path, "hash")["key"] == first["key"] and json.loads(record.read_text()) == kept


def test_the_files_digest_follows_each_python_and_library_files_size_and_time(tmp_path):
    (tmp_path / "_C").mkdir()
    for name in ("a.py", "_C/libtriton.so", "notes.txt"):
        (tmp_path / name).write_text("x")
    before = files_digest(tmp_path)
    os.utime(tmp_path / "notes.txt", ns=(1, 1))
    assert files_digest(tmp_path) == before  # not a file Triton's key hashes
    for name in ("a.py", "_C/libtriton.so"):
        os.utime(tmp_path / name, ns=(1, 1))
        changed = files_digest(tmp_path)
        assert changed != before
        before = changed
    (tmp_path / "a.py").write_text("xy")
    os.utime(tmp_path / "a.py", ns=(1, 1))
    assert files_digest(tmp_path) != before  # its size
