"""SmolVLM-256M's shapes on this machine's CPU, ours against transformers in the same run: an image question's
first token (the picture cut into tiles, encoded, the prompt read) and the reply's decode speed.

Random weights at SmolVLM-256M-Instruct's shapes (SigLIP-B/16 at 512 px, 4× pixel shuffle, a 30-layer
576-wide SmolLM2 decoder; the real files cannot be fetched here), written by `save_pretrained`, with a small
BPE tokenizer holding SmolVLM's special tokens; a 640×480 photo at the size the app reads pictures on a CPU
(longest edge 1,024: 2×2 tiles of 512 + the global view; the checkpoint's 2,048 gives 13 tiles). Ours:
`SmolVLMChatPipeline` as the app runs it (fp32); transformers: `Idefics3Processor` (its PIL image
processor, given the same size) and `Idefics3ForConditionalGeneration.generate`, greedy. Per reply of 33 tokens:
the first token (the best of `--repeats`, each with a new picture) and the decode speed between the first
and the last token (transformers' steps stamped by a logits processor; ours from the engine's statistics).
Prints a table, writes smolvlm_cpu.json to $OUT.

    python bench/smolvlm_cpu.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import transformers  # noqa: E402
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil  # noqa: E402

from test_smolvlm import SPECIALS  # noqa: E402
from test_smolvlm_chat import TEMPLATE  # noqa: E402
from timing import report  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.pipelines.smolvlm_chat import SmolVLMChatPipeline  # noqa: E402

QUESTION = [{"role": "user", "content": "What is in the picture?"}]
TOKENS = 33


def write_model(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["User: what is in the picture?\n\nAssistant: a cat on a mat.\n"] * 50,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end_of_utterance>",
                                                additional_special_tokens=SPECIALS[1:])
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512})
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=fast, image_seq_len=64,
                                               chat_template=TEMPLATE)
    config = transformers.Idefics3Config(
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=512, patch_size=16),
        text_config=dict(model_type="llama", vocab_size=49280, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
        scale_factor=4, image_token_id=tok.token_to_id("<image>"), tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Idefics3ForConditionalGeneration(config).eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)


def photo(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    res: dict = {"cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                        f"{torch.get_num_threads()} threads", "torch": torch.__version__,
                 "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
                 "shapes": "SmolVLM-256M-Instruct (random weights), fp32; a 640x480 photo at the app's CPU size "
                           "(longest edge 1,024: 2x2 tiles + the global view, 5 of 512 px)"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_model(folder)
        ours = SmolVLMChatPipeline.load(folder, "smolvlm-256m-shapes", "cpu", torch.float32, 2048, 1)
        edge = ours.images.longest_edge  # the app's size on a CPU; transformers' processor given the same
        processor = transformers.Idefics3Processor.from_pretrained(folder, image_processor=Idefics3ImageProcessorPil.
                                                                   from_pretrained(folder, size={"longest_edge": edge}))
        model = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder).eval()
        res["longest_edge"] = edge
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text":
                                              QUESTION[0]["content"]}]}], add_generation_prompt=True)

        def theirs(seed: int, tokens: int) -> tuple[float, float]:
            """(seconds to the first token, decode tok/s from the step times): a logits processor stamps steps."""
            stamps: list[float] = []

            def stamp(ids, scores):
                stamps.append(time.perf_counter())
                return scores

            start = time.perf_counter()
            inputs = processor(text=text, images=[photo(seed)], return_tensors="pt")
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0,
                               logits_processor=transformers.LogitsProcessorList([stamp]))
            return stamps[0] - start, (len(stamps) - 1) / (stamps[-1] - stamps[0])

        def mine(seed: int, tokens: int) -> tuple[float, float]:
            """(the picture's encode + the engine's time to the first token, decode tok/s). Not the first event
            with text: random weights may draw tokens that show none, and then the first text came with the
            last token (an earlier version of this bench timed that, 2 s late at 5 tiles)."""
            params = SamplingParams(max_new_tokens=tokens, temperature=0, repetition_penalty=1.0)
            picture, start, stats = photo(seed), time.perf_counter(), None
            ours.encode_image(picture)  # what the reply's first step does; the stream then finds it encoded
            encoded = time.perf_counter() - start
            for event in ours.stream(picture, QUESTION, params):
                stats = event.stats or stats
            assert stats.new_tokens == tokens, f"the reply ended after {stats.new_tokens} tokens: not comparable"
            return encoded + stats.time_to_first_token_s, stats.tokens_per_s

        seed = 0
        for name, fn in (("transformers", theirs), ("ours", mine)):
            runs = []
            for _ in range(args.repeats):
                seed += 1
                runs.append(fn(seed, TOKENS))
            res[f"{name}_first_token_s"] = round(min(r[0] for r in runs), 2)
            res[f"{name}_decode_tok_s"] = round(max(r[1] for r in runs), 1)
        ours.close()
    res["first_token_transformers_over_ours"] = round(res["transformers_first_token_s"] / res["ours_first_token_s"], 2)
    res["decode_ours_over_transformers"] = round(res["ours_decode_tok_s"] / res["transformers_decode_tok_s"], 2)
    report("smolvlm_cpu", res)


if __name__ == "__main__":
    main()
