"""A GGUF file as a model folder: its config and tokenizer files written once into our cache beside
a link to the file, so every loader that reads folders reads it (`checkpoint.read_tensors` takes the
tensors from the linked file; nothing is copied or dequantized ahead of time).

The folder's name holds the file's path, size and modification time: a replaced file gets a new
folder; building it is atomic and one process at a time, like the demo models'.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from filelock import FileLock

from pipeline.errors import UserError
from pipeline.files import atomic_folder
from pipeline.llm.weights.gguf_file import hf_config, read_gguf, split_parts
from pipeline.llm.weights.gguf_tokenizer import write_tokenizer_files

VERSION = "2"  # bumped when the files written here change: older folders are rebuilt


def _key(parts: list[Path]) -> str:
    digest = hashlib.sha256(VERSION.encode())
    for part in parts:
        stat = part.stat()
        digest.update(f"{part.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def gguf_model_dir(path: Path, cache_dir: Path) -> Path:
    """The model folder for the GGUF file at `path` (any part of a split one), made on first use. Links
    keep the parts' own names (a hub cache's files are links to blobs named by hash, and the names say
    which parts belong together)."""
    path = Path(path).absolute()
    parts = split_parts(path)
    folder = Path(cache_dir) / "gguf" / f"{parts[0].name.removesuffix('.gguf')}-{_key(parts)}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / "config.json").is_file():
            return folder
        model = read_gguf(parts[0])
        config = hf_config(model) | {"gguf": {"file": str(parts[0]), "quant_type": model.quant_type,
                                              "tensor_types": list(model.matrix_types)}}
        with atomic_folder(folder) as tmp:
            write_tokenizer_files(model, tmp)
            for part in parts:
                try:
                    os.symlink(part.resolve(), tmp / part.name)
                except OSError as e:
                    raise UserError(f"cannot link {part} into the cache ({e.strerror or e})") from None
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return folder
