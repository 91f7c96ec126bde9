"""MiniGPT-4 image encode (EVA ViT-g 224 + Q-Former) on the GPU: ours against transformers' BLIP-2
modules, same random weights at the real shapes, same run; ours eager and as the replayed CUDA
graph the pipeline uses. Prints a table; writes
minigpt4_encode.json under $OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import cuda_ms  # noqa: E402
from pipeline.cuda_graphs import CapturedCall  # noqa: E402
from pipeline.minigpt4.vision import MiniGPT4Vision, VisionConfig  # noqa: E402
from pipeline.minigpt4.weights import hf_to_original  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    from transformers import Blip2QFormerConfig, Blip2QFormerModel, Blip2VisionConfig, Blip2VisionModel

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    torch.manual_seed(0)
    vision = Blip2VisionModel(Blip2VisionConfig(hidden_size=1408, intermediate_size=6144, num_hidden_layers=39,
                                                num_attention_heads=16, image_size=224, patch_size=14,
                                                qkv_bias=True)).cuda().eval()
    qformer = Blip2QFormerModel(Blip2QFormerConfig(encoder_hidden_size=1408)).cuda().eval()
    query = torch.randn(1, 32, 768, device="cuda") * 0.02
    state = {f"vision_model.{k}": v for k, v in vision.state_dict().items()}
    state |= {f"qformer.{k}": v for k, v in qformer.state_dict().items()} | {"query_tokens": query}
    ours = MiniGPT4Vision(VisionConfig()).cuda().eval()
    mapped = hf_to_original(state)
    mapped |= {k: v for k, v in ours.state_dict().items() if k.startswith("llama_proj.")}
    ours.load_state_dict(mapped)
    x = torch.randn(1, 3, 224, 224, device="cuda")

    def hf_encode():
        image = vision(pixel_values=x).last_hidden_state
        return qformer(query_embeds=query, encoder_hidden_states=image).last_hidden_state

    with torch.inference_mode():
        ref = hf_encode()
        res["rel_err_ours_fp32"] = round(rel(ours.image_features(x), ref), 7)
        vision.half(), qformer.half()
        query = query.half()
        x16 = x.half()
        res["hf_fp16_ms"] = round(cuda_ms(lambda: qformer(query_embeds=query, encoder_hidden_states=vision(
            pixel_values=x16).last_hidden_state).last_hidden_state), 2)
        ours.half()
        res["rel_err_ours_fp16"] = round(rel(ours.image_features(x16), ref), 5)
        res["ours_fp16_ms"] = round(cuda_ms(lambda: ours(x16)), 2)
        graphed = CapturedCall(ours, x16)  # what ImageChatPipeline replays on a GPU
        res["graph_equals_eager_fp16"] = bool(torch.equal(graphed(x16), ours(x16)))
        res["ours_fp16_graph_ms"] = round(cuda_ms(lambda: graphed(x16)), 2)
        ours.bfloat16()
        xb = x.bfloat16()
        res["rel_err_ours_bf16"] = round(rel(ours.image_features(xb), ref), 5)
        res["ours_bf16_ms"] = round(cuda_ms(lambda: ours(xb)), 2)
    res["ratio_hf_fp16_over_ours_fp16_graph"] = round(res["hf_fp16_ms"] / res["ours_fp16_graph_ms"], 2)
    (OUT / "minigpt4_encode.json").write_text(json.dumps(res, indent=1))
    print("\n".join(f"{k:35s} {v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
