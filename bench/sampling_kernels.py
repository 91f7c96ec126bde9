"""The sampler's Triton kernels (`plugins.topk_sampling`) on the GPU at Qwen2.5-7B's vocabulary: µs per draw
(CUDA graphs), 1 and 8 rows, bf16 logits, the UI's sampling (top-k 20, top-p 0.8, penalty 1.05), as the
kernels are (the row strides specialised, always a multiple of 16: Triton's alignment hints) and with no
integer argument specialised (as from 2026-11-29's morning), the same tokens from both.

    python bench/sampling_kernels.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import report  # noqa: E402
from plugins import topk_sampling  # noqa: E402
from plugins.lowbit_tuning import graphed_us  # noqa: E402

VOCAB = 152064


def main() -> None:
    device = torch.device("cuda")
    as_is = topk_sampling._block_top_kernel
    variants = {"as is (row strides specialised)": as_is, "nothing specialised": topk_sampling.triton.jit(
        do_not_specialize=["V", "NB", "stride_l", "stride_s", "stride_c"])(as_is.fn)}
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "vocab": VOCAB}
    g = torch.Generator(device=device).manual_seed(0)
    for rows in (1, 8):
        logits = torch.randn(rows, VOCAB, device=device, generator=g).to(torch.bfloat16)
        seen = torch.rand(rows, VOCAB, device=device, generator=g) < 0.01
        columns = torch.tensor([[0.5] * rows, [0.7] * rows, [20.0] * rows, [0.8] * rows, [1.05] * rows], device=device)
        tokens = {}
        for name, kernel in variants.items():
            topk_sampling._block_top_kernel = kernel
            tokens[name] = topk_sampling.sample_top_k(logits, seen, columns)
            res[f"{rows} rows, {name} µs"] = graphed_us([lambda: topk_sampling.sample_top_k(logits, seen, columns)] * 8)
        topk_sampling._block_top_kernel = as_is
        res[f"{rows} rows, same tokens"] = bool(torch.equal(*tokens.values()))
    report("sampling_kernels", res)


if __name__ == "__main__":
    main()
