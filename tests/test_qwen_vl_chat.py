"""Qwen2.5-VL image chat on our engine (`pipeline/pipelines/qwen_vl_chat.py`) against transformers on a tiny
random Qwen2.5-VL written as `save_pretrained` writes one (and once more with the hub's flat config.json),
with Qwen2.5-VL-Instruct's chat template: the prompt ids of a two-turn conversation equal its processor's,
every token's M-RoPE position equals `get_rope_index`'s, and a reply's greedy tokens and log-probabilities
equal `Qwen2_5_VLForConditionalGeneration.generate`'s — so the picture's embeddings sit where they belong
and each rotary pair turns by its section's position."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pil_processing = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

from pipeline.errors import UserError  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.text.tokenizer import load_tokenizer  # noqa: E402
from pipeline.pipelines.qwen_vl_chat import QwenVLChatPipeline  # noqa: E402
from pipeline.pipelines.vlm_chat import language_model  # noqa: E402
from pipeline.qwen_vl.preprocess import PreprocessConfig  # noqa: E402
from pipeline.qwen_vl.text import load_text_decoder, text_config  # noqa: E402
from pipeline.qwen_vl.weights import load_vision  # noqa: E402

CELL = 28
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
# Qwen2.5-VL-Instruct's chat template (its chat_template.json), written from the released files' text
TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
TURNS = [{"role": "user", "content": "What is in it?"}, {"role": "assistant", "content": "a cat on a mat."},
         {"role": "user", "content": "hello world"}]
RNG = np.random.default_rng(1)
IMAGES = {"wide_60x300": RNG.integers(0, 256, (60, 300, 3), dtype=np.uint8),  # rows ≠ columns
          "tall_200x90": RNG.integers(0, 256, (200, 90, 3), dtype=np.uint8)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen2.5-VL folder as `save_pretrained` writes one: weights, config, tokenizer, processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["system\nYou are a helpful assistant.\nuser\nwhat is in the picture?\nassistant\na cat on a mat.\n",
              "hello world\n"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                                additional_special_tokens=SPECIALS[1:])
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, out_hidden_size=64,
                           window_size=2 * CELL, fullatt_block_indexes=[1]),
        text_config=dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # a trained-like spread: norms not all 1, biases not 0, positions that matter
        for name, p in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "embed_tokens" in name or "q_proj" in name or "k_proj" in name:
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("qwen_vl_chat")
    model.save_pretrained(path, max_shard_size="100KB")
    fast.save_pretrained(path)
    (path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": CELL * CELL * 4, "max_pixels": CELL * CELL * 40, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor"}))
    return path


@pytest.fixture(scope="module")
def hub_folder(folder, tmp_path_factory):
    """The same model with config.json as the hub ships Qwen2.5-VL: the decoder's keys at the top, M-RoPE
    as `rope_scaling: {"type": "mrope"}`."""
    path = tmp_path_factory.mktemp("qwen_vl_hub")
    shutil.copytree(folder, path, dirs_exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**cfg, **{k: v for k, v in text.items() if k != "model_type"}, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (path / "config.json").write_text(json.dumps(flat))
    return path


class ImageProcessor(transformers.Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without its video processor (which needs torchvision, absent here)."""

    def check_argument_for_proper_class(self, name, arg):
        return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)


def make_processor(folder):
    return ImageProcessor(
        image_processor=pil_processing.Qwen2VLImageProcessorPil.from_pretrained(folder),
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(folder), video_processor=None,
        chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def processor(folder):
    return make_processor(folder)


@pytest.fixture(scope="module")
def reference(folder):
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()


def load(folder) -> QwenVLChatPipeline:
    llm = language_model(load_text_decoder(folder), load_tokenizer(folder), "tiny-qwen-vl", "cpu", 1024, 4)
    return QwenVLChatPipeline(load_vision(folder), PreprocessConfig.from_folder(folder), llm)


@pytest.fixture(scope="module")
def pipeline(folder):
    chat = load(folder)
    yield chat
    chat.close()


def hf_turns(turns):
    return [{"role": m["role"], "content": ([{"type": "image"}] if i == 0 else []) + [{"type": "text", "text": m["content"]}]}
            for i, m in enumerate(turns)]


def hf_inputs(processor, image, turns):
    text = processor.apply_chat_template(hf_turns(turns), add_generation_prompt=True)
    return processor(text=text, images=[image], return_tensors="pt")


@pytest.mark.parametrize("name", IMAGES)
def test_prompt_ids_and_positions_equal_the_processor_and_get_rope_index(processor, reference, pipeline, name):
    inputs = hf_inputs(processor, IMAGES[name], TURNS)
    expected = inputs["input_ids"][0].tolist()
    _, encoded = pipeline.encode_image(IMAGES[name])
    prompt = pipeline.format(encoded).render(TURNS)
    assert list(prompt.ids) == expected
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    (start, length), = prompt.slots
    assert expected[start:start + length] == [pad] * length and expected.count(pad) == length
    positions, delta = reference.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                      image_grid_thw=inputs["image_grid_thw"])
    assert torch.equal(prompt.rope, positions[:, 0])
    assert prompt.shift(len(prompt)) == int(delta) != 0 and prompt.shift(0) == 0


def generate(processor, reference, image, turns, steps=8):
    """transformers' greedy reply: its tokens (up to a turn's end) and their log-probabilities."""
    inputs = hf_inputs(processor, image, turns)
    with torch.inference_mode():
        out = reference.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ref = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    stops = {processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    kept = next((i for i, t in enumerate(ref) if t in stops), len(ref))
    return ref[:kept], [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, ref[:kept])]


def reply(pipeline, image, turns, steps=8):
    params = SamplingParams(max_new_tokens=steps, temperature=0, repetition_penalty=1.0, logprobs=1)
    events = list(pipeline.stream(image, turns, params))
    return "".join(e.text for e in events), [t.logprob for e in events for t in e.logprobs or []]


@pytest.mark.parametrize("name", IMAGES)
def test_a_replys_greedy_tokens_equal_transformers(processor, reference, pipeline, name):
    tokens, theirs = generate(processor, reference, IMAGES[name], TURNS)
    text, ours = reply(pipeline, IMAGES[name], TURNS)
    assert len(tokens) >= 4 and text == processor.tokenizer.decode(tokens, skip_special_tokens=True)
    # within the vision tower's float32 rounding (its windows batched, theirs one by one: ~3e-5 relative)
    assert np.allclose(ours[:len(tokens)], theirs, atol=2e-3), (ours, theirs)


def test_given_their_picture_embeddings_the_decoder_is_exact(processor, reference, folder):
    """With transformers' own picture embeddings in the slot, every log-probability is theirs to 1e-5: the M-RoPE
    positions of the picture, of the text after it and of the reply are theirs."""
    image = IMAGES["tall_200x90"]
    inputs = hf_inputs(processor, image, TURNS)
    with torch.inference_mode():
        features = reference.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    chat = load(folder)
    try:
        key, encoded = chat.encode_image(image)
        chat.pictures.items[key] = dataclasses.replace(encoded, embeds=(torch.cat(list(features)),))  # (the picture cache)
        tokens, theirs = generate(processor, reference, image, TURNS)
        text, ours = reply(chat, image, TURNS)
    finally:
        chat.close()
    assert text == processor.tokenizer.decode(tokens, skip_special_tokens=True)
    # to float32's last bits (a step's sums may run in another order than theirs: its decode attention reads the
    # cache, masked past the row's length); a position off by one moves them by far more
    assert np.allclose(ours[:len(tokens)], theirs, rtol=0, atol=1e-5), (ours, theirs)


def test_the_hubs_flat_config_loads_the_same_decoder(folder, hub_folder, processor):
    assert text_config(hub_folder) == text_config(folder)
    assert text_config(folder).mrope_section == (2, 3, 3)
    chat = load(hub_folder)
    try:
        params = SamplingParams(max_new_tokens=4, temperature=0, repetition_penalty=1.0)
        image = IMAGES["wide_60x300"]
        assert "".join(e.text for e in chat.stream(image, TURNS[:1], params))
    finally:
        chat.close()


def test_a_wrong_mrope_section_is_refused_by_name(hub_folder, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hub_folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_scaling"]["mrope_section"] = [2, 2, 2]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="mrope_section"):
        text_config(bad)
    del cfg["rope_scaling"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="mrope_section"):
        text_config(bad)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_decoder_weights_answer_close_to_the_float_ones(folder, pipeline, mode):
    """`--quant int8|int4` quantizes the VLM's decoder as the chat model's (here the CPU's reference path)."""
    llm = language_model(load_text_decoder(folder), load_tokenizer(folder), "tiny-qwen-vl", "cpu", 1024, 4, mode)
    chat = QwenVLChatPipeline(load_vision(folder), PreprocessConfig.from_folder(folder), llm)
    try:
        assert f"{mode} weights" in chat.description
        assert type(chat.llm.engine.runner.model.layers[0].attn.wqkv).__name__ == "QuantLinear"
        image = IMAGES["tall_200x90"]
        _, quantized = reply(chat, image, TURNS, steps=1)
        _, full = reply(pipeline, image, TURNS, steps=1)
        assert abs(quantized[0] - full[0]) < (0.005 if mode == "int8" else 0.02), (quantized, full)  # 6e-4, 2e-3 seen
    finally:
        chat.close()
