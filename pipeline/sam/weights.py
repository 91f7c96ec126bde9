"""Where SAM checkpoints come from: a local `.pth`, our cache, a download, or the built-in demo."""

from __future__ import annotations

from pathlib import Path

import torch
from filelock import FileLock

from pipeline.errors import UserError
from pipeline.random_weights import spread_weights
from pipeline.sam.model import VARIANTS, Sam
from pipeline.weights_io import write_weight_file

CHECKPOINTS = {  # the official releases (facebookresearch/segment-anything; MobileSAM: ChaoningZhang/MobileSAM)
    "sam_vit_h": "https://dl.fbaipublicfiles.com/segment_anything/sam_vit_h_4b8939.pth",
    "sam_vit_l": "https://dl.fbaipublicfiles.com/segment_anything/sam_vit_l_0b3195.pth",
    "sam_vit_b": "https://dl.fbaipublicfiles.com/segment_anything/sam_vit_b_01ec64.pth",
    "mobile_sam": "https://github.com/ChaoningZhang/MobileSAM/raw/master/weights/mobile_sam.pt",
}
DEMO = "demo/sam-tiny"
DEMO_SEED = 4321


def _build_demo(path: Path) -> None:
    """Random weights with some spread (so clicks give varied masks), in the official `.pth` layout."""
    write_weight_file(path, spread_weights(lambda: Sam(VARIANTS["demo"]), DEMO_SEED).state_dict())


def locate_sam(name: str, cache_dir: Path) -> tuple[Path, str]:
    """The checkpoint path for `name` (a registry name, the demo, or a `.pth` path) and its source."""
    if name == DEMO:
        return Path(cache_dir) / "sam" / "sam_demo_tiny.pth", "built-in demo"
    if name in CHECKPOINTS:
        path = Path(cache_dir) / "sam" / CHECKPOINTS[name].rsplit("/", 1)[1]
        return path, "cache" if path.is_file() else "download"
    if Path(name).is_file():
        return Path(name), "local file"
    raise UserError(f"unknown SAM model {name!r}: use {', '.join(CHECKPOINTS)}, {DEMO} or a .pth file")


def resolve_sam(name: str, cache_dir: Path) -> Path:
    """Like `locate_sam`, then build the demo or download the checkpoint (with a progress bar)."""
    path, source = locate_sam(name, cache_dir)
    if source in ("local file", "cache") or (source == "built-in demo" and path.is_file()):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return path
        if source == "built-in demo":
            _build_demo(path)
            return path
        try:  # writes to a temporary file and renames it when complete
            torch.hub.download_url_to_file(CHECKPOINTS[name], str(path), progress=True)
        except Exception as e:
            raise UserError(f"could not download {name} ({type(e).__name__}); offline? fetch "
                            f"{CHECKPOINTS[name]} elsewhere and pass --sam /path/to/file.pth") from None
    return path
