"""Weight-file fingerprints (`engine_builder/fingerprint.py`): the digest of every file's SHA-256 in order,
hashed side by side, each file once (later launches read the memo), a changed file hashed again."""

import hashlib
from pathlib import Path

import pytest

from engine_builder import fingerprint as fp
from pipeline import files as files_module


def expected(files: list[Path]) -> str:
    total = hashlib.sha256()
    for f in files:
        total.update(hashlib.sha256(f.read_bytes()).hexdigest().encode())
    return total.hexdigest()[:32]


def test_the_digest_of_the_files_digests_in_order_each_file_hashed_once(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    files = [folder / f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * (3 * files_module.READ // 2 + i))  # more than one read each
    (folder / "config.json").write_text("{}")  # not a weight file
    memo = tmp_path / "engines"
    memo.mkdir()
    first = fp.fingerprint([folder], memo)
    assert first == expected(files)

    def no_hashing(path, progress):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(fp, "file_sha256", no_hashing)
    assert fp.fingerprint([folder], memo) == first  # from the memo
    monkeypatch.undo()
    files[2].write_bytes(b"changed")
    assert fp.fingerprint([folder], memo) == expected(files) != first


@pytest.mark.parametrize("workers", [1, 4])
def test_side_by_side_hashing_gives_the_same_digests(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(fp.os, "cpu_count", lambda: workers)
    files = [tmp_path / f"part{i}.bin" for i in range(3)]
    for i, f in enumerate(files):
        f.write_bytes(bytes(range(256)) * (1000 + i))
    assert fp.fingerprint(files, tmp_path) == expected(files)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_large_file_is_hashed_in_segments_side_by_side(tmp_path, monkeypatch, workers):
    """A file over one segment: the SHA-256 of its size and its segments' SHA-256s, in order, whichever thread
    hashed which; a file of one segment: its plain SHA-256 (as `sha256sum` prints it)."""
    monkeypatch.setattr(files_module, "SEGMENT", 1000)
    monkeypatch.setattr(files_module, "READ", 300)
    monkeypatch.setattr(files_module.os, "cpu_count", lambda: workers)
    data = bytes(range(256)) * 17 + b"end"  # 4,355 bytes: 5 segments, the last one short
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    big.write_bytes(data)
    small.write_bytes(data[:1000])
    segments = [hashlib.sha256(data[i:i + 1000]).hexdigest() for i in range(0, len(data), 1000)]
    seen = []
    assert files_module.file_sha256(big, seen.append) == \
        hashlib.sha256(f"{len(data)}:{','.join(segments)}".encode()).hexdigest()
    assert sum(seen) == len(data) and max(seen) <= 300
    assert files_module.file_sha256(small) == hashlib.sha256(data[:1000]).hexdigest()
    big.write_bytes(data[:-1] + b"E")
    assert files_module.file_sha256(big) != hashlib.sha256(f"{len(data)}:{','.join(segments)}".encode()).hexdigest()
