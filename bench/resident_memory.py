"""All three tools resident at real shapes with int4 LLMs: peak GPU memory (issue 10, must-show 2).

Writes random-weight checkpoints at real shapes in the real formats (Qwen2.5-7B and Vicuna-7B as
transformers folders, EVA ViT-g + Q-Former + MiniGPT-4 projection as the three original `.pth` files,
SAM ViT-H as the official `.pth`), then loads the tools through the app's own loaders
(`studio.compose.tool_specs`, warm-ups included) with `--quant int4 --gpu-memory 16 --max-batch 1`, twice: the
first launch quantizes into the cache, the second loads from it. Reports
`torch.cuda.max_memory_allocated` after all three are loaded, and each tool's load time and size.

    python bench/resident_memory.py            # on the GPU (about 35 GB of disk for the checkpoints)
    python bench/resident_memory.py --smoke    # tiny shapes on the CPU: checks the script, measures nothing
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from studio import compose  # noqa: E402
from studio.config import parse_config  # noqa: E402
from studio.plan import make_plan  # noqa: E402
from pipeline.service.tools import Tool  # noqa: E402
from timing import report  # noqa: E402
from pipeline.llm.weights.checkpoint import write_checkpoint  # noqa: E402
from pipeline.llm.weights.config import DecoderConfig, config_from_hf  # noqa: E402
from pipeline.llm.demo import demo_model_dir  # noqa: E402
from pipeline.llm.model.decoder import Decoder  # noqa: E402
from pipeline.minigpt4.vision import TINY, VisionConfig  # noqa: E402
from pipeline.minigpt4.weights import build_demo  # noqa: E402
from pipeline.sam.model import VARIANTS, Sam  # noqa: E402
from pipeline.service.tools import GIB, ToolHost  # noqa: E402
from pipeline.weights_io import write_weight_file  # noqa: E402

QWEN25_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "max_position_embeddings": 32768, "rope_theta": 1e6, "tie_word_embeddings": False}
VICUNA_7B = DecoderConfig(family="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                          num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=2048)


def random_llm(folder: Path, config: DecoderConfig, tokenizer_from: Path, device: str) -> None:
    """A transformers folder of random bf16 weights (made on `device`, written from the CPU)."""
    with torch.device("meta"):
        model = Decoder(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.02)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    del model
    write_checkpoint(folder, config, state, "hf")
    for f in tokenizer_from.iterdir():  # the demo's tokenizer files (a smaller vocabulary fits a bigger table)
        if f.name != "config.json" and f.suffix != ".safetensors" and "index" not in f.name:
            shutil.copy2(f, folder / f.name)


def write_checkpoints(root: Path, smoke: bool, device: str) -> dict[str, Path]:
    demo = Path(tempfile.mkdtemp(dir=root))
    qwen_cfg = config_from_hf({**QWEN25_7B, **({"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
                                                 "num_hidden_layers": 2, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2} if smoke else {})})
    vicuna_cfg = VICUNA_7B if not smoke else DecoderConfig(family="llama", vocab_size=1024, hidden_size=256,
                                                           intermediate_size=512, num_layers=2, num_heads=4,
                                                           num_kv_heads=4, head_dim=64, max_position_embeddings=2048)
    paths = {"qwen": root / "qwen2.5-7b", "vicuna": root / "vicuna-7b", "vision": root / "minigpt4",
             "sam": root / "sam_vit_h.pth"}
    random_llm(paths["qwen"], qwen_cfg, demo_model_dir("demo/qwen2-tiny", demo), device)
    random_llm(paths["vicuna"], vicuna_cfg, demo_model_dir("demo/llama-tiny", demo), device)
    paths["vision"].mkdir()
    build_demo(paths["vision"], vicuna_cfg.hidden_size, TINY if smoke else VisionConfig())
    write_weight_file(paths["sam"], Sam(VARIANTS["demo" if smoke else "vit_h"]).state_dict())
    return paths


def launch_all(paths: dict[str, Path], cache: Path, device: str) -> dict:
    os.environ["STUDIO_CACHE"] = str(cache)
    args = parse_config(["--weights", str(paths["qwen"]), "--sam", str(paths["sam"]),
                              "--minigpt4-ckpt", str(paths["vision"] / "prerained_minigpt4_7b.pth"),
                              "--minigpt4-vision", str(paths["vision"]), "--minigpt4-llm", str(paths["vicuna"]),
                              "--quant", "int4", "--gpu-memory", "16", "--max-batch", "1", "--backend", "torch",
                              "--device", device, "--dtype", "bfloat16"])
    plan = make_plan(args)
    engines = compose.engine_options(args)
    host = ToolHost(torch.device(device), int(16 * GIB), engines.report.say)
    for spec in compose.tool_specs(args, plan, engines, host):
        host.add(spec)
    out: dict = {}
    if device == "cuda":
        out["allocated_before_GiB"] = round(torch.cuda.memory_allocated() / GIB, 2)  # 0: nothing left over
        torch.cuda.reset_peak_memory_stats()
    for name in Tool:
        start = time.perf_counter()
        host.load(name)
        out[f"{name} load_s"] = round(time.perf_counter() - start, 1)
    out["tools"] = host.status()
    out["all loaded"] = all(host.loaded(n) is not None for n in Tool)
    if device == "cuda":
        out["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        out["allocated_GiB"] = round(torch.cuda.memory_allocated() / GIB, 2)
    host.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "resident-memory")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    res: dict = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d")}
    start = time.perf_counter()
    paths = write_checkpoints(args.dir, args.smoke, device)
    res["checkpoints_written_s"] = round(time.perf_counter() - start, 1)
    res["first launch (quantizes into the cache)"] = launch_all(paths, args.dir / "cache", device)
    res["second launch (from the cache)"] = launch_all(paths, args.dir / "cache", device)
    report("resident_memory", res)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
