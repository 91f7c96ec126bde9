"""A safetensors file read onto a GPU in pieces (`weights_io._read_pieces`) holds what safetensors' own reader
gives: every dtype, tensors straddling pieces, empty and 0-d tensors, a filter; a file shorter than its index
is a `UserError`. Here on the CPU (the same path, unpinned); on a GPU in `tests/test_gpu.py`."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import weights_io
from pipeline.errors import UserError


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(13, 7, generator=g).bfloat16(), "scale": torch.randn(5, generator=g),
            "packed": torch.randint(-2**31, 2**31 - 1, (3, 11), dtype=torch.int32, generator=g),
            "odd_bytes": torch.randint(0, 255, (17,), dtype=torch.uint8, generator=g),
            "mask": torch.rand(9, generator=g) > 0.5, "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
            "half": torch.randn(4, 3, generator=g).half(), "wide": torch.randn(3, generator=g).double(),
            "step": torch.tensor(42, dtype=torch.int64), "none": torch.empty(0, 4)}


@pytest.mark.parametrize("piece", [5, 64, 1 << 20])
def test_pieces_give_what_safetensors_reads(tmp_path, monkeypatch, piece):
    path = tmp_path / "w.safetensors"
    save_file(tensors(), str(path), metadata={"format": "pt"})  # as other tools write it
    monkeypatch.setattr(weights_io, "PIECE", piece)
    expected = load_file(str(path))
    got = weights_io._read_pieces(path, lambda k: True, torch.device("cpu"))
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name].view(torch.uint8) if value.dtype == torch.float8_e4m3fn else got[name],
                           value.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else value), name
    kept = weights_io._read_pieces(path, lambda k: k in ("scale", "mask"), torch.device("cpu"))
    assert kept.keys() == {"scale", "mask"} and torch.equal(kept["mask"], expected["mask"])


def test_a_file_shorter_than_its_index_is_a_user_error(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_file(tensors(), str(path))
    path.write_bytes(path.read_bytes()[:-20])
    monkeypatch.setattr(weights_io, "PIECE", 16)
    with pytest.raises(UserError, match="truncated"):
        weights_io._read_pieces(path, lambda k: True, torch.device("cpu"))
