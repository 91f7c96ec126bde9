"""Where SAM checkpoints come from: a local `.pth`, our cache, a download, or the built-in demo."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from filelock import FileLock
from huggingface_hub import hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError
from tqdm import tqdm

from pipeline.errors import UserError
from pipeline.models import download_failure, hub_reachable
from pipeline.random_weights import spread_weights
from pipeline.sam.model import VARIANTS, Sam
from pipeline.weights_io import write_weight_file

CHECKPOINTS = {  # the official releases (facebookresearch/segment-anything; MobileSAM: ChaoningZhang/MobileSAM)
    "sam_vit_h": "https://dl.fbaipublicfiles.com/segment_anything/sam_vit_h_4b8939.pth",
    "sam_vit_l": "https://dl.fbaipublicfiles.com/segment_anything/sam_vit_l_0b3195.pth",
    "sam_vit_b": "https://dl.fbaipublicfiles.com/segment_anything/sam_vit_b_01ec64.pth",
    "mobile_sam": "https://github.com/ChaoningZhang/MobileSAM/raw/master/weights/mobile_sam.pt",
}
# Those also on the Hugging Face hub come from there (huggingface_hub's client: progress, Cancel, a dropped
# connection resumed where it stopped); the rest from the URLs above.
HUB = {"mobile_sam": ("dhkim2810/MobileSAM", "mobile_sam.pt")}
SIZES = {"mobile_sam": "40 MB", "sam_vit_b": "375 MB", "sam_vit_l": "1.2 GB", "sam_vit_h": "2.4 GB"}
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
        if path.is_file():
            return path, "cache"
        # where `huggingface-cli download dhkim2810/MobileSAM` (or another app) put it: found without the network
        hub = try_to_load_from_cache(*HUB[name]) if name in HUB else None
        return (Path(hub), "cache") if isinstance(hub, str) else (path, "download")
    if Path(name).is_file():
        return Path(name), "local file"
    if Path(name).suffix in (".pth", ".pt") or "/" in name or os.sep in name:
        raise UserError(f"{name} does not exist" + (" (it is a folder: give the .pth file in it)"
                                                   if Path(name).is_dir() else ""))
    raise UserError(f"unknown SAM model {name!r}: use {', '.join(CHECKPOINTS)}, {DEMO} or a .pth file")


def resolve_sam(name: str, cache_dir: Path, tqdm_class: type[tqdm] | None = None) -> Path:
    """Like `locate_sam`, then build the demo or download the checkpoint (progress through `tqdm_class`,
    which may raise to cancel: that propagates, and the next try fetches the file again: huggingface_hub
    1.x+ drops an unfinished one)."""
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
        try:
            if name in HUB:  # into our cache folder (written aside, renamed once complete)
                hub_reachable()
                hf_hub_download(*HUB[name], local_dir=path.parent, tqdm_class=tqdm_class)
            else:  # writes to a temporary file and renames it when complete
                torch.hub.download_url_to_file(CHECKPOINTS[name], str(path), progress=True)
        except (OSError, ValueError, RuntimeError, HfHubHTTPError) as e:  # offline, not found, disk full
            where = f"the Hugging Face hub ({'/'.join(HUB[name])})" if name in HUB else CHECKPOINTS[name]
            raise UserError(f"could not download {name} from {where}: {download_failure(e)}. Fetch {CHECKPOINTS[name]} elsewhere "
                            f"and pass --sam /path/to/file") from None
    return path

