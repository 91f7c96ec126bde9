"""What exact verify rows cost (issue 32): speculative decoding's verify step of one chat runs its rows
through the low-bit layers as one-row calls would (`plugins.lowbit.rows_as_one_row`), so that greedy
tokens stay those of plain decoding. Per Qwen2.5-7B layer shape, the one-row launch tuned here (as the
app tunes it), then 2, 3, 5 and 9 rows (draft sizes 1, 2, 4, 8) at several output rows per program:
microseconds, the ratio to one row, whether every row equals its one-row call bit for bit (the app
runs them on the one-row tile, marked *; the others show what a narrower or wider tile would cost, and
that it need not be exact); and the batch kernel (tensor cores, the tuned 2–16-row launch) at the same
rows, which rounds otherwise.

    python bench/verify_rows.py   # on a CUDA GPU; prints a table last, writes verify_rows.json to $OUT
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import report  # noqa: E402
from pipeline.llm.weights.quant import quantize  # noqa: E402
from plugins import lowbit  # noqa: E402
from plugins.lowbit_tuning import fastest, graphed_us  # noqa: E402

SHAPES = {"qkv": (3584, 4608, "int4", False), "o": (3584, 3584, "int4", False),
          "gate_up": (3584, 37888, "int4", True), "down": (18944, 3584, "int4", False),
          "lm_head": (3584, 152064, "int8", False)}
ROWS = (2, 3, 5, 9)
BLOCKS = (32, 64, 128)
COPIES = 8  # weight copies walked per timing: past the L2 cache for every shape but o and qkv's pairs


def layers_for(n_in: int, n_out: int, mode: str, gated: bool) -> list[lowbit.LowBitWeight]:
    workspace = lowbit.Workspace(torch.device("cuda"))
    parts = quantize(torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * 0.02, mode, torch.bfloat16)
    bits = 4 if mode == "int4" else 8
    return [lowbit.LowBitWeight.from_parts(parts, bits, torch.bfloat16, None, workspace, gated) for _ in range(COPIES)]


def main() -> None:
    torch.manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name()}
    for name, (n_in, n_out, mode, gated) in SHAPES.items():
        layers = layers_for(n_in, n_out, mode, gated)
        one = fastest(layers, 1)
        batch = fastest(layers, 8)
        for layer in layers:
            layer.config, layer.batch_config = one, batch
        x1 = torch.randn(1, n_in, device="cuda", dtype=torch.bfloat16)
        base = graphed_us([lambda i=i: layers[i % COPIES](x1) for i in range(24)])
        row: dict = {"one_row": dataclasses.asdict(one), "one_row_us": round(base, 2)}
        for rows in ROWS:
            x = torch.randn(1, rows, n_in, device="cuda", dtype=torch.bfloat16)
            alone = torch.cat([layers[0](x[:, i:i + 1]) for i in range(rows)], 1)
            plain = graphed_us([lambda i=i: layers[i % COPIES](x) for i in range(24)])
            row[f"r{rows}_batch_kernel_x"] = round(plain / base, 3)
            blocks = sorted({*BLOCKS, one.block_n})
            for block_n in blocks if one.kernel != "mma" else [one.block_n]:
                config = dataclasses.replace(one, block_n=block_n)
                with lowbit.rows_as_one_row():
                    try:
                        same = torch.equal(layers[0](x, config), alone)
                        us = graphed_us([lambda i=i: layers[i % COPIES](x, config) for i in range(24)])
                    except Exception as e:  # noqa: BLE001 - a launch this GPU cannot compile: say so
                        row[f"r{rows}_bn{block_n}"] = f"failed: {type(e).__name__}"
                        continue
                chosen = "*" if block_n == one.block_n else ""  # the tile the app runs them on
                row[f"r{rows}_bn{block_n}{chosen}_x"] = round(us / base, 3)
                row[f"r{rows}_bn{block_n}_bitwise"] = same
        res[name] = row
        print(name, row, flush=True)
        torch.cuda.empty_cache()
    report("verify_rows", res)


if __name__ == "__main__":
    main()
