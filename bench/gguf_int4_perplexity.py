"""The real SmolLM2 GGUF file (Q4_1) as int4 on the low-bit kernels against the same int4 weights on the
reference path (each layer dequantized at its call), float and int8 beside them, in one run (issue 40).

Why: `--quant auto` runs a Q4_0/Q4_1 file as int4 in its own blocks of 32 (`studio.backends.gguf_modes`), on
the kernels since they take groups of 32 and pad SmolLM2's 576-wide inputs to whole chunks; this checks that
the kernels give the reference path's perplexity on real weights, and where int8 stands.

The GPU has no tokenizer packages: the model folder (config, tokenizer files; `pipeline.models.locate` made
it) and the evaluation text's token ids are prepared on another machine (`--prepare`), the file carried beside.

    python bench/gguf_int4_perplexity.py --prepare DIR          # here: DIR/model (no weights), DIR/ids.json
    python bench/gguf_int4_perplexity.py --folder DIR/model --ids DIR/ids.json   # the GPU; the .gguf in the folder
Writes gguf_int4_perplexity.json to $OUT; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.llm.evaluate import agreement, score_text  # noqa: E402
from pipeline.llm.model.loading import load_decoder  # noqa: E402
from pipeline.llm.weights.quant import quantize_decoder, use_kernels  # noqa: E402

MODEL_ID = "builtin/smollm2-135m-instruct"


def prepare(out: Path) -> None:
    """The model's folder without its weights, and the evaluation text's ids (needs the app's packages)."""
    from pipeline.llm.text.tokenizer import load_tokenizer
    from pipeline.models import locate

    folder = locate(MODEL_ID).path
    shutil.copytree(folder, out / "model", symlinks=True, ignore=shutil.ignore_patterns("*.gguf"))
    ids = load_tokenizer(folder).encode((ROOT / "assets" / "eval_text.txt").read_text())
    (out / "ids.json").write_text(json.dumps(ids))


def measure(folder: Path, ids: list[int], device: str) -> dict:
    dtype = torch.bfloat16
    rows: dict = {}
    base = score_text(load_decoder(folder, dtype=dtype, device=device).eval(), ids)
    rows["float"] = {"perplexity": base.perplexity, "agreement_vs_float": 1.0}
    for mode in ("int4", "int8"):
        model = quantize_decoder(load_decoder(folder, dtype=dtype, device="cpu"), mode, device).to(device).eval()
        start = time.perf_counter()
        reference = score_text(model, ids)
        ref_s = time.perf_counter() - start
        moved = use_kernels(model)
        start = time.perf_counter()
        kernels = score_text(model, ids)
        rows[f"{mode} reference path"] = {"perplexity": reference.perplexity, "s": ref_s,
                                          "agreement_vs_float": agreement(reference, base)}
        rows[f"{mode} kernels"] = {"perplexity": kernels.perplexity, "s": time.perf_counter() - start,
                                   "agreement_vs_float": agreement(kernels, base), "layers_on_kernels": moved,
                                   "agreement_vs_reference_path": agreement(kernels, reference),
                                   "perplexity_x_reference_path": kernels.perplexity / reference.perplexity}
        del model
    return {"device": torch.cuda.get_device_name() if device == "cuda" else device, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "dtype": "bfloat16", "scored_tokens": base.tokens, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", type=Path)
    ap.add_argument("--folder", type=Path)
    ap.add_argument("--ids", type=Path)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    res = measure(args.folder, json.loads(args.ids.read_text()), args.device)
    out = Path(os.environ.get("OUT", "."))
    (out / "gguf_int4_perplexity.json").write_text(json.dumps(res, indent=2))
    print(f"{res['device']} {res['date']} bf16, {res['scored_tokens']} tokens scored")
    for name, row in res["rows"].items():
        extra = f"  ×ref {row['perplexity_x_reference_path']:.5f}" if "perplexity_x_reference_path" in row else ""
        print(f"{name:22} ppl {row['perplexity']:9.4f}  top-1 vs float {row['agreement_vs_float']:.4f}{extra}")


if __name__ == "__main__":
    main()
