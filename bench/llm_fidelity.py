"""bf16 fidelity of our decoder vs transformers' bf16, both against transformers in fp32.

Same random Qwen-7B-shaped weights for all three; several prompts; depth 1, 4 and 32 layers (the
models are cut to their first layers), so a systematic difference shows apart from the chaos that
random weights amplify with depth. Prints a table; writes llm_fidelity.json under $OUT.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.llm.weights.checkpoint import to_internal  # noqa: E402
from pipeline.llm.weights.config import config_from_hf  # noqa: E402
from pipeline.llm.weights.families import HF_LAYOUT  # noqa: E402
from pipeline.llm.model.decoder import Decoder  # noqa: E402
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=151936, max_position_embeddings=8192,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf32 = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf32.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    sd16 = {k: v.to(torch.bfloat16) for k, v in hf32.state_dict().items()}
    hf16 = Qwen2ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    hf16.load_state_dict(sd16)
    config = config_from_hf(cfg.to_dict())
    with torch.device("meta"):
        ours = Decoder(config)
    ours.load_state_dict(to_internal(config, dict(sd16), HF_LAYOUT), assign=True)
    ours.eval()
    cache, rope = KVCache(config, 1, 512, torch.bfloat16, "cuda"), RotaryTables(config, 512, "cuda")
    prompts = [torch.randint(0, 150000, (1, 128), generator=torch.Generator().manual_seed(s)).cuda() for s in range(4)]
    full = (hf32.model.layers, hf16.model.layers, ours.layers)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with torch.inference_mode():
        for depth in (1, 4, 32):
            hf32.model.layers, hf16.model.layers, ours.layers = (m[:depth] for m in full)
            hf32.config.num_hidden_layers = hf16.config.num_hidden_layers = depth
            ours_err, hf_err = [], []
            for ids in prompts:
                ref = hf32(ids).logits[0].double()
                hf_err.append(rel(hf16(ids).logits[0], ref))
                ours_err.append(rel(ours(cache, rope, (Prefill(0, 0),), tokens=ids)[0], ref))
            res[f"depth{depth}_ours_bf16_vs_fp32"] = [round(e, 5) for e in ours_err]
            res[f"depth{depth}_hf_bf16_vs_fp32"] = [round(e, 5) for e in hf_err]
    Path(os.environ.get("OUT", "/tmp")).joinpath("llm_fidelity.json").write_text(json.dumps(res, indent=1))
    print("\n".join(f"{k:32s} {v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
