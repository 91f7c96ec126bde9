"""Qwen2.5-VL-7B shapes on the GPU, ours against transformers in the same run (random bf16 weights: the real
checkpoint cannot be fetched here). Written once with `save_pretrained` and loaded by our loaders, as the app
loads a downloaded folder.

- the picture's encode (window-attention ViT + patch merger) in ms, for a 980×980 picture (1,225 positions,
  the app's cap of 1,280), and how far each bf16 embedding is from the float32 one;
- an image question's reply: decode tok/s (ours: the engine's own decode time with CUDA graphs; transformers:
  `generate` with its default cache, the time of 129 new tokens less that of 1), and how many greedy
  tokens agree;
- our VLM decode against our text chat at the same shapes (the same decoder, a text prompt of the same
  length): the M-RoPE shift must cost nothing (target: within 0.95×).

Prints a table and writes qwen_vl_gpu.json to $OUT.

    python bench/qwen_vl_gpu.py [--new 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import cuda_ms, report  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402
from pipeline.qwen_vl.preprocess import PreprocessConfig, preprocess  # noqa: E402
from pipeline.qwen_vl.prompt import rope_positions  # noqa: E402
from pipeline.qwen_vl.text import load_text_decoder  # noqa: E402
from pipeline.qwen_vl.weights import load_vision  # noqa: E402

PAD, START, END = 151655, 151652, 151653
CAP = 1280 * 28 * 28  # the app's cap (`qwen_vl_chat.MAX_IMAGE_TOKENS`)


def reference_model():
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
                         rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}),
        image_token_id=PAD, video_token_id=151656, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def seconds(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def engine_reply(engine: TorchLLMEngine, prompt: Prompt, new: int) -> tuple[list[int], float]:
    stream = engine.submit(prompt, SamplingParams(max_new_tokens=new, temperature=0), stop_ids=set())
    tokens = list(stream)
    return tokens, stream.stats.tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
                 "weights": "random, Qwen2.5-VL-7B-Instruct shapes"}
    hf = reference_model()
    rng = np.random.default_rng(0)
    picture = rng.integers(0, 256, (980, 980, 3), dtype=np.uint8)
    images = PreprocessConfig(max_pixels=CAP)
    patches = preprocess(picture, images)
    pixels, grid = patches.pixels.to("cuda", torch.bfloat16), torch.tensor([patches.grid], device="cuda")
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        t = time.perf_counter()
        hf.save_pretrained(folder)
        res["save_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        vision = load_vision(Path(folder), "cuda", torch.bfloat16)
        decoder = load_text_decoder(Path(folder), torch.bfloat16, "cuda")
        res["our_load_s"] = round(time.perf_counter() - t, 1)
    with torch.inference_mode():
        theirs_fn = lambda: hf.model.visual(pixels, grid_thw=grid)  # noqa: E731
        ours_fn = lambda: vision(pixels, patches.grid)  # noqa: E731
        theirs = theirs_fn()
        theirs = getattr(theirs, "pooler_output", theirs)
        ours = ours_fn()
        res["image_positions"] = int(ours.shape[0])
        exact = copy.deepcopy(hf.model.visual).float()(pixels.float(), grid_thw=grid)  # the float32 reference
        exact = getattr(exact, "pooler_output", exact)

        def apart(a: torch.Tensor, b: torch.Tensor) -> float:
            return round(((a.float() - b.float()).norm() / b.float().norm()).item(), 5)

        res["image_embeds_rel_err_ours_vs_transformers"] = apart(ours, theirs)
        res["image_embeds_rel_err_vs_fp32_ours"] = apart(ours, exact)
        res["image_embeds_rel_err_vs_fp32_transformers"] = apart(theirs, exact)
        del exact
        res["encode_ms_transformers"] = round(cuda_ms(theirs_fn, warm=2, iters=10), 2)
        res["encode_ms_ours"] = round(cuda_ms(ours_fn, warm=2, iters=10), 2)
        res["encode_speedup"] = round(res["encode_ms_transformers"] / res["encode_ms_ours"], 2)

        n = ours.shape[0]
        head = rng.integers(0, 150000, 24).tolist()
        tail = rng.integers(0, 150000, 24).tolist()
        ids = head + [START] + [PAD] * n + [END] + tail
        t_, h_, w_ = patches.grid
        m = images.merge_size
        slots = ((len(head) + 1, n),)
        prompt = Prompt(tuple(ids), slots, (ours,), ("picture",),
                        rope_positions(Prompt(tuple(ids), slots), [(t_, h_ // m, w_ // m)]))
        text = Prompt(tuple(head + rng.integers(0, 150000, n + 2).tolist() + tail))
        input_ids = torch.tensor([ids], device="cuda")
        inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                      image_grid_thw=grid, mm_token_type_ids=(input_ids == PAD).int())

        def generate(new: int):
            return hf.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=0, output_logits=True, return_dict_in_generate=True)

        reference = generate(args.new)
        ref_tokens = reference.sequences[0, len(ids):].tolist()
        one = statistics.median(seconds(lambda: generate(1)) for _ in range(args.repeats))
        full = statistics.median(seconds(lambda: generate(args.new + 1)) for _ in range(args.repeats))
        res["decode_tok_s_transformers"] = round(args.new / (full - one), 1)
    del hf
    torch.cuda.empty_cache()
    engine = TorchLLMEngine(decoder, 4096, decoder.config.vocab_size, max_batch=1)
    try:
        engine_reply(engine, text, 8)  # first kernels and graph captures
        ours_tokens, _ = engine_reply(engine, prompt, args.new)
        speeds = {"vlm": [], "text": []}
        for _ in range(args.repeats):  # interleaved: a busy spell hits both alike
            speeds["vlm"].append(engine_reply(engine, dataclasses.replace(prompt, keys=(uuid.uuid4().hex,)),
                                              args.new)[1])  # a new key: nothing cached, the whole prompt read
            speeds["text"].append(engine_reply(engine, fresh_text(text, rng), args.new)[1])
        res["decode_tok_s_ours"] = round(statistics.median(speeds["vlm"]), 1)
        res["decode_tok_s_ours_text_chat"] = round(statistics.median(speeds["text"]), 1)
    finally:
        engine.close()
    same = next((i for i, (a, b) in enumerate(zip(ours_tokens, ref_tokens)) if a != b), min(len(ours_tokens), len(ref_tokens)))
    res["greedy_tokens_agreeing"] = f"{same} of {args.new} (bf16: a near tie may part them)"
    res["decode_speedup_vs_transformers"] = round(res["decode_tok_s_ours"] / res["decode_tok_s_transformers"], 2)
    res["vlm_decode_vs_text_chat"] = round(res["decode_tok_s_ours"] / res["decode_tok_s_ours_text_chat"], 3)
    report("qwen_vl_gpu", res)


def fresh_text(text: Prompt, rng) -> Prompt:
    """A text prompt of the same length no earlier run cached."""
    return Prompt(tuple([int(rng.integers(0, 150000))] + list(text.ids[1:])))


if __name__ == "__main__":
    main()
