"""First-call cost of masked attention (a prefill after a cached prefix) for shapes never seen before.

Each turn of a conversation prefills a new number of tokens against a new number of cached keys,
so any per-shape planning cost lands on the user's time to first token. Compares SDPA's default
backend choice with cuDNN attention switched off, at Qwen2.5-7B's attention shape (28/4 heads).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def first_and_second_ms(q_len: int, kv_len: int) -> tuple[float, float]:
    q = torch.randn(1, 28, q_len, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, kv_len, 128, device="cuda", dtype=torch.bfloat16)
    mask = (torch.arange(kv_len, device="cuda")[None] <= torch.arange(kv_len - q_len, kv_len, device="cuda")[:, None])
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, k, attn_mask=mask[None, None], enable_gqa=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1]


def main() -> None:
    rows = []
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for q_len, kv_len in ((201 + cudnn, 1700 + cudnn), (203 + cudnn, 2450 + cudnn), (150 + cudnn, 3200 + cudnn)):
            first, second = first_and_second_ms(q_len, kv_len)
            rows.append((f"cudnn_sdp={cudnn} q={q_len} kv={kv_len}", f"first {first:.1f} ms, again {second:.2f} ms"))
    print("\n".join(f"{a:40s} {b}" for a, b in rows))


def steady_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def gqa_prefix_prefill() -> None:
    """A follow-up turn's prefill (201 new tokens over 3,200 cached) with grouped KV heads: SDPA's
    GQA flag with a mask, against the KV heads expanded first, flash/efficient backends only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 28, 201, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, 3200, 128, device="cuda", dtype=torch.bfloat16)
    mask = (torch.arange(3200, device="cuda")[None] <= torch.arange(2999, 3200, device="cuda")[:, None])[None, None]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        gqa = steady_ms(lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True))
        expanded = steady_ms(lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(7, 1), k.repeat_interleave(7, 1), attn_mask=mask))
    print(f"{'GQA prefix prefill, enable_gqa + mask':40s} {gqa:.3f} ms per layer")
    print(f"{'GQA prefix prefill, heads expanded + mask':40s} {expanded:.3f} ms per layer")


if __name__ == "__main__":
    main()
    gqa_prefix_prefill()
