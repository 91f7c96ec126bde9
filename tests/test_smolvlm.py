"""SmolVLM's image side against transformers' Idefics3 on one tiny random checkpoint (fp32).

The reference processor is `Idefics3ImageProcessorPil` (the PIL one SmolVLM was trained with; the
default `Idefics3ImageProcessor` needs torchvision, which this venv does not have).
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
pil_processing = pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")

from pipeline.images import load_image  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.model.kv_cache import KVCache  # noqa: E402
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.text.prompt import Prompt  # noqa: E402
from pipeline.llm.text.tokenizer import load_tokenizer  # noqa: E402
from pipeline.smolvlm.preprocess import PreprocessConfig, preprocess  # noqa: E402
from pipeline.llm.text.prompt import expand_images  # noqa: E402
from pipeline.smolvlm.prompt import IMAGE, image_ids, image_text  # noqa: E402
from pipeline.smolvlm.text import load_text_decoder  # noqa: E402
from pipeline.smolvlm.vision import SmolVLMVision, VisionConfig  # noqa: E402
from pipeline.smolvlm.weights import config_from_hf, load_vision, read_vision_tensors, to_ours  # noqa: E402

TILE, PATCH, SCALE, LONGEST = 32, 4, 2, 128  # 8×8 patches a tile, 16 tokens after the shuffle, ≤ 4×4 tiles
SEQ = (TILE // PATCH // SCALE) ** 2
SPECIALS = ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>"] + \
    [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
TEXT = "<|im_start|>User:<image>What is in it?<end_of_utterance>\nAssistant:"
RNG = np.random.default_rng(0)
IMAGES = {  # height × width, odd sizes: tall, wide, tiny (upscaled), grayscale
    "37x300": RNG.integers(0, 256, (37, 300, 3), dtype=np.uint8),
    "1000x513": RNG.integers(0, 256, (1000, 513, 3), dtype=np.uint8),
    "20x20": RNG.integers(0, 256, (20, 20, 3), dtype=np.uint8),
    "gray_50x90": RNG.integers(0, 256, (50, 90), dtype=np.uint8),
}


def rgb(image: np.ndarray) -> np.ndarray:
    """What the app hands the pipeline: `load_image`'s RGB uint8 (a grayscale file's gray repeated)."""
    return load_image(image)


def as_uploaded(image: np.ndarray) -> np.ndarray | Image.Image:
    """What the processor is given: the array, a grayscale one as the PIL image it came from."""
    return Image.fromarray(image) if image.ndim == 2 else image


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny SmolVLM folder as `save_pretrained` writes one: weights, config, tokenizer, processor configs."""
    return make_folder(tmp_path_factory.mktemp("smolvlm"))


def make_folder(path, text_width: int = 48):
    """`folder`'s model in `path`, its decoder `text_width` wide (MLP twice that)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["User: what is in the picture?\n\nAssistant: a cat on a mat.\n", "hello world\n\n"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert len(tok.encode("\n\n").ids) == 1  # "\n\n" is one token, as in SmolLM2's vocabulary: the grid's end
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end_of_utterance>",
                                                additional_special_tokens=SPECIALS[1:])
    images = pil_processing.Idefics3ImageProcessorPil(size={"longest_edge": LONGEST}, max_image_size={"longest_edge": TILE})
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=fast, image_seq_len=SEQ)
    config = transformers.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=TILE, patch_size=PATCH),
        text_config=dict(model_type="llama", vocab_size=tok.get_vocab_size(), hidden_size=text_width,
                         intermediate_size=2 * text_width,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False),
        scale_factor=SCALE, image_token_id=tok.token_to_id(IMAGE), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # a trained-like spread: norms not all 1, biases not 0, positions that matter
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "embed" in name and "patch" not in name:
                p.normal_(0, 0.5)
    model.save_pretrained(path, max_shard_size="100KB")  # sharded, with an index
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(folder):
    processor = transformers.Idefics3Processor(
        image_processor=pil_processing.Idefics3ImageProcessorPil.from_pretrained(folder),
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(folder), image_seq_len=SEQ)
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder).eval()
    return processor, model


@pytest.fixture(scope="module")
def ours(folder):
    return PreprocessConfig.from_folder(folder), load_vision(folder), load_tokenizer(folder)


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("split", [True, False])
def test_pixels_match_the_processor(reference, ours, name, split):
    processor, _ = reference
    config = dataclasses.replace(ours[0], split=split)
    ref = processor.image_processor(as_uploaded(IMAGES[name]), do_image_splitting=split, return_row_col_info=True,
                                    return_tensors="pt")
    tiles = preprocess(rgb(IMAGES[name]), config)
    assert (tiles.rows, tiles.cols) == (ref["rows"][0][0], ref["cols"][0][0])
    assert tiles.pixels.shape == ref["pixel_values"][0].shape
    assert (tiles.pixels - ref["pixel_values"][0]).abs().max().item() <= 1e-6
    assert torch.equal(tiles.pixel_mask, ref["pixel_attention_mask"][0])


def test_tile_grids_cover_the_cases(ours):
    grids = {name: (t.rows, t.cols) for name in IMAGES for t in [preprocess(rgb(IMAGES[name]), ours[0])]}
    assert grids == {"37x300": (1, 4), "1000x513": (4, 3), "20x20": (4, 4), "gray_50x90": (3, 4)}


@pytest.mark.parametrize("name", IMAGES)
def test_prompt_ids_match_the_processor(reference, ours, name):
    processor, _ = reference
    tokenizer = ours[2]
    ref = processor(text=TEXT, images=[as_uploaded(IMAGES[name])])["input_ids"][0]
    tiles = preprocess(rgb(IMAGES[name]), ours[0])
    image_id = tokenizer.special_id(IMAGE)
    rendered = processor.tokenizer(TEXT)["input_ids"]  # the template's text, its one <image> a special token
    prompt = expand_images(rendered, image_id, [image_ids(tokenizer, tiles.rows, tiles.cols, SEQ)])
    assert list(prompt.ids) == ref
    assert processor.tokenizer(TEXT.replace(IMAGE, image_text(tiles.rows, tiles.cols, SEQ)))["input_ids"] == ref
    assert len(prompt.slots) == tiles.pixels.shape[0]
    inside = {i for start, length in prompt.slots for i in range(start, start + length)}
    assert inside == {i for i, t in enumerate(ref) if t == image_id}


def test_names_map_onto_every_vision_tensor_and_only_those(folder):
    mapped = to_ours(read_vision_tensors(folder))
    assert set(mapped) == set(SmolVLMVision(config_from_hf(json.loads((folder / "config.json").read_text()))).state_dict())


def test_config_of_smolvlm_256m():
    """SmolVLM-256M-Instruct's config.json shapes (the keys it sets) give its processor's image_seq_len, 64."""
    c = config_from_hf({"model_type": "idefics3", "scale_factor": 4, "text_config": {"hidden_size": 576},
                        "vision_config": {"hidden_size": 768, "image_size": 512, "intermediate_size": 3072,
                                          "num_attention_heads": 12, "num_hidden_layers": 12, "patch_size": 16}})
    assert c == VisionConfig() and c.tokens_per_image == 64


def hf_features(model, pixels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = model.model.get_image_features(pixels[None], mask[None])
    return out.pooler_output[0].view(pixels.shape[0], SEQ, -1)


@pytest.mark.parametrize("name", ["37x300", "20x20"])
def test_image_features_match_transformers(reference, ours, name):
    _, model = reference
    tiles = preprocess(rgb(IMAGES[name]), ours[0])
    with torch.inference_mode():
        got = ours[1](tiles.pixels, tiles.pixel_mask)
        assert torch.equal(ours[1](tiles.pixels), got)  # no mask: whole tiles, the engine's path
    ref = hf_features(model, tiles.pixels, tiles.pixel_mask)
    assert got.shape == ref.shape == (tiles.pixels.shape[0], SEQ, 48)
    assert rel_err(got, ref) <= 1e-5


def test_padded_tiles_match_transformers(reference, ours):
    """Tiles padded at the bottom and right (pixel mask) spread their real patches over the position table."""
    _, model = reference
    pixels = torch.randn(3, 3, TILE, TILE, generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(3, TILE, TILE, dtype=torch.int64)
    for i, (h, w) in enumerate([(TILE, TILE), (18, 30), (20, 12)]):  # 18 and 30: the last patch row/column is part-real
        mask[i, :h, :w] = 1
    pixels = pixels * mask[:, None]
    with torch.inference_mode():
        got = ours[1](pixels, mask)
    assert rel_err(got, hf_features(model, pixels, mask)) <= 1e-5


def prompt_and_features(reference, ours, name: str):
    processor, _ = reference
    inputs = processor(text=TEXT, images=[as_uploaded(IMAGES[name])], return_tensors="pt")
    tiles = preprocess(rgb(IMAGES[name]), ours[0])
    tokenizer = ours[2]
    prompt = expand_images(processor.tokenizer(TEXT)["input_ids"], tokenizer.special_id(IMAGE),
                           [image_ids(tokenizer, tiles.rows, tiles.cols, SEQ)])
    with torch.inference_mode():
        features = ours[1](tiles.pixels, tiles.pixel_mask)
    return inputs, prompt, features


def test_logits_match_transformers(reference, ours, folder):
    _, model = reference
    inputs, prompt, features = prompt_and_features(reference, ours, "37x300")
    decoder = load_text_decoder(folder)
    ids = torch.tensor([prompt.ids])
    with torch.inference_mode():
        embeds = decoder.embed(ids)
        for (start, length), tile in zip(prompt.slots, features):
            embeds[0, start:start + length] = tile
        cache = KVCache(decoder.config, 1, 256, torch.float32, "cpu")
        got = decoder(cache, RotaryTables(decoder.config, 256, "cpu"), (Prefill(row=0, start=0),), embeds=embeds)
        ref = model(**inputs).logits
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= 1e-4


def test_greedy_tokens_match_transformers(reference, ours, folder):
    """The engine's own path: a `Prompt` whose slots hold each tile's embeddings."""
    _, model = reference
    inputs, prompt, features = prompt_and_features(reference, ours, "20x20")
    steps = 8
    with torch.inference_mode():
        ref = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    engine = TorchLLMEngine(load_text_decoder(folder), context=512, vocab_size=model.config.text_config.vocab_size)
    filled = Prompt(prompt.ids, prompt.slots, tuple(features), tuple(f"img/{i}" for i in range(len(features))))
    got = list(engine.submit(filled, SamplingParams(max_new_tokens=steps, temperature=0, repetition_penalty=1.0),
                             stop_ids=set()))
    engine.close()
    assert got == ref and len(set(got)) > 3  # a real sequence, not one token repeated
