"""A prompt chunk's attention on the GPU, Qwen2.5-7B heads (28 q heads, 4 KV heads of 128, bf16), one layer:
our split kernel over the row in place (`plugins.decode_attention` with `row`, tiles of 32, 64, 128 and 256
head rows) against what it replaced in the same run: FlashAttention's variable-length kernel
(`aten._flash_attention_forward`) over a copy of the row's keys (`index_select`, as the step made it), and
SDPA's flash kernel over the row in place (`plugins.chunk_attention.prefill_attention`, how a prompt read eagerly
attends). Long chunks (1,024 and 2,048 tokens deep into 32k) are a lone prompt's steps, where the engine takes
`LONG_TILE_ROWS`.

Per (chunk size, chunk start): µs per layer of each (a CUDA graph's replay), the ratio, and the error of each against fp32 SDPA
(causal aligned to the last key). The engine's chunk step runs 28 of these; the running chats' gap while a
prompt joins (`bench/chunked_prefill.py`) is where they show.

    python bench/chunk_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import cuda_ms, report  # noqa: E402
from plugins import decode_attention as da  # noqa: E402
from plugins.chunk_attention import prefill_attention  # noqa: E402
from pipeline.llm.engine.model_runner import PREFILL_ATTENTION  # noqa: E402

HEADS, KV_HEADS, DIM, ROWS, MAX_SEQ = 28, 4, 128, 8, 32768 + 512
CASES = [(128, 0), (128, 3872), (256, 0), (256, 3744), (256, 16000), (512, 3584), (256, 32000), (1024, 0),
         (1024, 8192), (1024, 30000), (2048, 16384), (2048, 30000)]
TILES = (32, 64, 128, 256)


def flash_varlen(q, k_cache, v_cache, row, start, size, kv_len):
    """The replaced path: the row's first kv_len keys copied out, then FlashAttention varlen (kv count on device)."""
    keys, values = (c[:, :, :kv_len].index_select(0, row)[0] for c in (k_cache, v_cache))
    cum_q = torch.arange(2, device=q.device, dtype=torch.int32) * size
    cum_k = torch.cat([torch.zeros(1, device=q.device, dtype=torch.int32), (start + size).to(torch.int32)])
    return torch.ops.aten._flash_attention_forward(q, keys.transpose(0, 1), values.transpose(0, 1), cum_q, cum_k,
                                                   size, kv_len, 0.0, True, False, scale=DIM ** -0.5)[0]


def graphed_us(fn) -> float:
    """µs of one replay of `fn` captured in a CUDA graph (as the engine runs it: no host time in it)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return round(cuda_ms(graph.replay, warm=5, iters=50) * 1e3, 1)


def main() -> None:
    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(ROWS, KV_HEADS, MAX_SEQ, DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    row = torch.tensor([3], device="cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "shapes": "28 q heads, 4 KV heads of 128, bf16, one layer"}
    for size, start in CASES:
        kv_len = MAX_SEQ  # the engine's: the whole cache (the grid follows it, no length)
        q = torch.randn(size, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        lengths = torch.arange(start + 1, start + size + 1, device="cuda")
        start_t = torch.tensor([start], device="cuda")
        exact = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k_cache[3:4, :, :start + size].float(),
                                               v_cache[3:4, :, :start + size].float(),
                                               attn_mask=causal_lower_right(size, start + size), enable_gqa=True)
        exact = exact[0].transpose(0, 1).reshape(size, HEADS * DIM)

        def error(y):
            return round(((y.float().reshape(size, -1) - exact).norm() / exact.norm()).item(), 5)

        flash = lambda: flash_varlen(q, k_cache, v_cache, row, start_t, size, kv_len)  # noqa: E731
        row_res = {"flash_varlen_us": graphed_us(flash), "flash_error": error(flash())}
        torch.cuda.synchronize()
        print(f"chunk {size} at {start}, flash varlen: {row_res['flash_varlen_us']} µs", flush=True)
        for tile in TILES:
            rows = row.expand(size)  # (a stride of 0: the kernel reads it as a contiguous copy)
            ours = lambda: da.decode_attention(q, k_cache, v_cache, lengths, kv_len, rows=rows, tile_rows=tile)  # noqa: E731
            row_res[f"ours_tile{tile}_us"] = graphed_us(ours)
            row_res[f"ours_tile{tile}_error"] = error(ours())
            row_res[f"flash_over_ours_tile{tile}"] = round(row_res["flash_varlen_us"] / row_res[f"ours_tile{tile}_us"], 2)
            torch.cuda.synchronize()
            print(f"chunk {size} at {start}, tile {tile}: {row_res[f'ours_tile{tile}_us']} µs", flush=True)

        def in_place():  # as the engine reads a prompt eagerly (`PREFILL_ATTENTION`: flash, no cuDNN)
            with sdpa_kernel(PREFILL_ATTENTION):
                return prefill_attention(q.transpose(0, 1)[None], k_cache[3:4, :, :start + size],
                                         v_cache[3:4, :, :start + size], start)
        row_res["sdpa_in_place_us"] = graphed_us(in_place)
        res[f"chunk {size} at {start}"] = row_res
    report("chunk_attention", res)
    print(f"\n{res['device']}: µs per layer ({res['shapes']}); error against fp32 SDPA")
    print(f"{'chunk at':16s} {'SDPA in place':>14s} " + " ".join(f"{'tile ' + str(t):>13s}" for t in TILES))
    for name, r in res.items():
        if name.startswith("chunk "):
            print(f"{name[6:]:16s} {r['sdpa_in_place_us']:14.1f} " + " ".join(
                f"{r[f'ours_tile{t}_us']:8.1f} {r[f'ours_tile{t}_error']:.0e}" for t in TILES))


if __name__ == "__main__":
    main()
