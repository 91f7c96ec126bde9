"""Reading and writing weight files (safetensors, PyTorch `.bin`/`.pth`) for every loader.

Weight files are big downloads, so users meet truncated, corrupt and mixed-up ones; each of those
becomes one `UserError` that names the file and says what to do, here, instead of a traceback from
whichever loader met it. `.bin`/`.pth` files load with `weights_only=True`: a pickle holding code is
refused, never run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open
from torch import Tensor

from pipeline.errors import UserError
from pipeline.files import atomic_write

ZIP_MAGIC, PICKLE_MAGIC, LFS_POINTER = b"PK", b"\x80", b"version https://git-lfs"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else 'no details'}"[:200]


SAFETENSORS_TYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                     "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                     "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
PIECE = 64 << 20  # bytes per read into a pinned buffer; PIECES of them in flight
PIECES = 4


def _safetensors_index(f: BinaryIO) -> tuple[dict, int]:
    """A safetensors file's index (each tensor's dtype, shape and byte range; "__metadata__") and where the
    tensors' bytes start, read from the file open as `f` at its start."""
    size = int.from_bytes(f.read(8), "little")
    return json.loads(f.read(size)), 8 + size


def _read_safetensors(path: Path, keep: Callable[[str], bool], device: torch.device | None) -> dict[str, Tensor]:
    with safe_open(str(path), framework="pt") as f:  # (also checks the index against the file's size)
        if device is None or device.type != "cuda":
            return {k: f.get_tensor(k) for k in f.keys() if keep(k)}
    return _read_pieces(path, keep, device)


def _read_pieces(path: Path, keep: Callable[[str], bool], device: torch.device) -> dict[str, Tensor]:
    """The kept tensors of a safetensors file, on `device`, read in large pieces through pinned buffers (by
    `PIECES` threads) rather than through the file's memory map: there each 4 KB page faulted in as the copy
    to the GPU touched it (a 7B chat's 5.5 GB of int4 weights: 1.1 s; H200, 2026-11-30)."""
    with path.open("rb", buffering=0) as f:
        index, base = _safetensors_index(f)
        fd = f.fileno()
        spans = sorted((e["data_offsets"][0], e["data_offsets"][1], name) for name, e in index.items()
                       if name != "__metadata__" and keep(name))
        out = {name: torch.empty(index[name]["shape"], dtype=SAFETENSORS_TYPES[index[name]["dtype"]], device=device)
               for _, _, name in spans}
        if not spans:
            return out
        first, end = spans[0][0], max(stop for _, stop, _ in spans)
        pinned = device.type == "cuda"
        buffers = [torch.empty(min(PIECE, end - first), dtype=torch.uint8, pin_memory=pinned) for _ in range(PIECES)]
        copied: list[torch.cuda.Event | None] = [None] * PIECES  # the copies out of each buffer
        stream = torch.cuda.Stream(device) if pinned else None

        def read(piece: int) -> int:
            at, buffer = first + piece * PIECE, buffers[piece % PIECES]
            if copied[piece % PIECES] is not None:
                copied[piece % PIECES].synchronize()
            view, got = memoryview(buffer.numpy())[:min(PIECE, end - at)], 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], base + at + got)
                if n <= 0:
                    raise UserError("it is truncated (shorter than its index says); re-download it")
                got += n
            return at

        count = -(-(end - first) // PIECE)
        with ThreadPoolExecutor(PIECES) as pool, torch.cuda.stream(stream) if pinned else contextlib.nullcontext():
            reads = [pool.submit(read, piece) for piece in range(min(PIECES, count))]
            for piece in range(count):
                at, buffer = reads[piece].result(), buffers[piece % PIECES]
                for start, stop, name in spans:  # each tensor's bytes within this piece
                    lo, hi = max(start, at), min(stop, at + PIECE)
                    if lo < hi:
                        out[name].view(-1).view(torch.uint8)[lo - start:hi - start].copy_(
                            buffer[lo - at:hi - at], non_blocking=pinned)
                if pinned:
                    copied[piece % PIECES] = torch.cuda.Event()
                    copied[piece % PIECES].record(stream)
                if piece + PIECES < count:
                    reads.append(pool.submit(read, piece + PIECES))
        if pinned:
            stream.synchronize()
        return out


def _read_torch(path: Path, mmap: bool) -> dict[str, Tensor]:
    """A `.bin`/`.pth` state dict; one wrapped in a `model` entry (LAVIS, MiniGPT-4) is unwrapped."""
    data = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    if not isinstance(data, dict):
        raise UserError(f"it holds a {type(data).__name__}, not named tensors; give a state dict checkpoint")
    bad = next((k for k, v in data.items() if not isinstance(v, Tensor)), None)
    if bad is not None:
        raise UserError(f"its entry {bad!r} is not a tensor but {type(data[bad]).__name__}; "
                        f"give a state dict checkpoint")
    return data


def _read(path: Path, keep: Callable[[str], bool], device: torch.device | None) -> dict[str, Tensor]:
    """The tensors of an existing file; raises `UserError` (reason and advice, without the file name)."""
    safetensors = path.suffix == ".safetensors"
    with path.open("rb") as f:
        head = f.read(len(LFS_POINTER))
    if head.startswith(LFS_POINTER):
        raise UserError("it is a Git LFS pointer, not the weights; fetch them (git lfs pull) or re-download")
    if len(head) < 9:
        raise UserError("it is truncated (empty or nearly); re-download it")
    if safetensors and head[8:9] != b"{" or not safetensors and not head.startswith((ZIP_MAGIC, PICKLE_MAGIC)):
        raise UserError(f"it is not a {'safetensors' if safetensors else 'PyTorch'} weights file "
                        f"(it starts with {head[:4].hex(' ')}); check that this is the right file")
    try:
        if safetensors:
            return _read_safetensors(path, keep, device)
        return {k: v for k, v in _read_torch(path, mmap=head.startswith(ZIP_MAGIC)).items() if keep(k)}
    except UserError:
        raise
    except Exception as e:  # the loaders are called right, so what they trip over is the file's content
        unpickling = isinstance(e, pickle.UnpicklingError)
        if unpickling and (code := re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", str(e))):
            raise UserError(f"it holds Python objects besides tensors ({code[1]}), which are not loaded "
                            f"because that could run code; use a checkpoint of plain tensors") from None
        # torch wraps the unpickler's own error (the useful part) in a long weights_only notice
        cause = e.__context__ if unpickling and e.__context__ else e
        raise UserError(f"it is truncated or corrupt ({_first_line(cause)}); re-download it") from None


def read_weight_file(path: Path, what: str = "weights file", keep: Callable[[str], bool] = lambda k: True,
                     device: torch.device | None = None) -> dict[str, Tensor]:
    """The tensors (named as in the file, those whose names `keep` accepts) of a `.safetensors` file or a
    `.bin`/`.pth` state dict; `what` names the file's role in error messages ("SAM checkpoint"). A GPU
    `device`: a safetensors file's tensors are read onto it (others' stay on the CPU)."""
    path = Path(path)
    try:
        if path.is_dir():
            raise UserError("it is a folder; give the weights file in it")
        if not path.exists():
            raise UserError("it does not exist; check the path")
        return _read(path, keep, device)
    except (UserError, OSError) as e:  # OSError: opening it (permissions, a failing disk)
        reason = e if isinstance(e, UserError) else _first_line(e)
        raise UserError(f"cannot read {what} {path}: {reason}") from None


SAFETENSORS_BYTES = {name: t.itemsize for name, t in SAFETENSORS_TYPES.items() if t.is_floating_point}  # the floats


def loaded_bytes(path: Path, dtype: torch.dtype) -> int:
    """What `path`'s tensors take once loaded with floats no wider than `dtype`, read from the file's
    index, not its data: a float32 SAM-H file of 2.6 GB holds 1.3 GB of bfloat16, and a memory budget
    planning by file sizes would unload a tool it did not need to. The file's size where the index
    cannot be read (a legacy pickle, a damaged file: the loader will say what is wrong)."""
    try:
        if path.suffix == ".safetensors":
            with path.open("rb") as f:
                header, _ = _safetensors_index(f)
            total = 0
            for name, entry in header.items():
                if name != "__metadata__":
                    stored = entry["data_offsets"][1] - entry["data_offsets"][0]
                    width = SAFETENSORS_BYTES.get(entry["dtype"])
                    total += stored * min(width, dtype.itemsize) // width if width else stored
            return total
        return sum(t.numel() * (min(t.element_size(), dtype.itemsize) if t.is_floating_point() else t.element_size())
                   for t in _read_torch(path, mmap=True).values())
    except Exception:  # noqa: BLE001 - any unreadable index: fall back to the size on disk
        return path.stat().st_size


def read_json(path: Path) -> dict:
    """A checkpoint's `config.json` or shard index; a truncated or mangled one is a `UserError`."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise UserError(f"cannot read {path}: it is not valid JSON ({_first_line(e)}); re-download it") from None
    if not isinstance(data, dict):
        raise UserError(f"cannot read {path}: it holds a JSON {type(data).__name__}, not an object; re-download it")
    return data


def weight_files(folder: Path) -> list[Path]:
    """A transformers folder's weight files: those its index lists, else the single file, else every
    `*.safetensors`."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            return [folder / name for name in sorted(set(read_json(folder / index).get("weight_map", {}).values()))]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return [folder / single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise UserError(f"no weights in {folder} (expected model.safetensors or an index of shards)")
    return found


def write_weight_file(path: Path, tensors: dict) -> None:
    """`torch.save` `tensors` (a state dict, or one wrapped as the original checkpoint wraps it) atomically.
    For small files (the demos'): it is written from memory."""
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    atomic_write(path, buffer.getvalue())


def check_tensors(expected: dict[str, Tensor], state: dict[str, Tensor], model: str, hint: str = "",
                  extra_ok: bool = False) -> None:
    """A `UserError` naming the first tensor `state` lacks, holds beyond `expected` (unless `extra_ok`) or
    holds in another shape than `expected`'s, in `model`'s words (`hint`: what config.json says)."""
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing:
        raise UserError(f"{model} weights lack {len(missing)} vision tensors, e.g. {missing[0]}{hint}")
    if extra and not extra_ok:
        raise UserError(f"{model} weights hold {len(extra)} vision tensors config.json has no place for, "
                        f"e.g. {extra[0]}{hint}")
    wrong = [k for k, v in expected.items() if state[k].shape != v.shape]
    if wrong:
        raise UserError(f"{model} tensor {wrong[0]} is {tuple(state[wrong[0]].shape)}, but config.json makes it "
                        f"{tuple(expected[wrong[0]].shape)}: the config and weights disagree")
