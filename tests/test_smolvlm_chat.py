"""SmolVLM image chat on our engine (`pipeline/pipelines/smolvlm_chat.py`) against transformers on a tiny
random SmolVLM written as `save_pretrained` writes one, with SmolVLM-Instruct's chat template: the prompt
ids of a two-turn conversation equal its processor's (the picture with the first user turn, one slot per
tile), and a reply's greedy tokens equal `Idefics3ForConditionalGeneration.generate`'s."""

import json
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pil_processing = pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")

from test_smolvlm import IMAGES, SEQ, folder  # noqa: E402,F401 - the tiny checkpoint fixture
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.language_model import LanguageModel  # noqa: E402
from pipeline.llm.text.tokenizer import load_tokenizer  # noqa: E402
from pipeline.pipelines.smolvlm_chat import SmolVLMChatPipeline  # noqa: E402
from pipeline.smolvlm.preprocess import PreprocessConfig  # noqa: E402
from pipeline.smolvlm.text import load_text_decoder  # noqa: E402
from pipeline.smolvlm.weights import load_vision  # noqa: E402

# SmolVLM-256M/500M-Instruct's chat template (its chat_template.json)
TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]"
            "['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if "
            "line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
            "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
TURNS = [{"role": "user", "content": "What is in it?"}, {"role": "assistant", "content": "a cat on a mat."},
         {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def model_folder(folder):  # noqa: F811
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def processor(model_folder):
    return transformers.Idefics3Processor(
        image_processor=pil_processing.Idefics3ImageProcessorPil.from_pretrained(model_folder),
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(model_folder), image_seq_len=SEQ,
        chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def pipeline(model_folder):
    decoder = load_text_decoder(model_folder)
    engine = TorchLLMEngine(decoder, context=1024, vocab_size=decoder.config.vocab_size)
    llm = LanguageModel(load_tokenizer(model_folder), engine, "tiny-smolvlm", "a tiny SmolVLM")
    chat = SmolVLMChatPipeline(load_vision(model_folder), PreprocessConfig.from_folder(model_folder), llm)
    yield chat
    chat.close()


def hf_turns(turns):
    out = []
    for i, m in enumerate(turns):
        content = [{"type": "text", "text": m["content"]}]
        out.append({"role": m["role"], "content": ([{"type": "image"}] if i == 0 else []) + content})
    return out


@pytest.mark.parametrize("name", ["37x300", "20x20"])
def test_a_conversations_prompt_ids_equal_the_processors(processor, pipeline, name):
    image = IMAGES[name]
    text = processor.apply_chat_template(hf_turns(TURNS), add_generation_prompt=True)
    expected = processor(text=text, images=[image], return_tensors="pt")["input_ids"][0].tolist()
    _, encoded = pipeline.encode_image(image)
    prompt = pipeline.format(encoded).render(TURNS)
    assert list(prompt.ids) == expected
    assert len(prompt.slots) == len(encoded.embeds) and all(length == SEQ for _, length in prompt.slots)
    assert all(expected[start] == processor.tokenizer.convert_tokens_to_ids("<image>") for start, _ in prompt.slots)


def test_a_replys_greedy_tokens_equal_transformers(model_folder, processor, pipeline):
    image = IMAGES["37x300"]
    turns = TURNS[:1]
    text = processor.apply_chat_template(hf_turns(turns), add_generation_prompt=True)
    inputs = processor(text=text, images=[image], return_tensors="pt")
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(model_folder).eval()
    steps = 8
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ref = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    stop = processor.tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    kept = ref.index(stop) if stop in ref else len(ref)
    params = SamplingParams(max_new_tokens=steps, temperature=0, repetition_penalty=1.0, logprobs=1)
    events = list(pipeline.stream(image, turns, params))
    reply = "".join(e.text for e in events)
    assert reply == processor.tokenizer.decode(ref[:kept], skip_special_tokens=True) and reply.strip()
    # each token's log-probability as transformers computes it (so every tile's embeddings are where they belong)
    ours = [t.logprob for e in events for t in e.logprobs or []]
    theirs = [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in zip(out.logits, ref[:kept])]
    assert len(ours) >= kept and np.allclose(ours[:kept], theirs, atol=1e-4), (ours, theirs)
    assert pipeline.encoder_runs >= 1


def test_a_processors_chat_template_json_is_read(model_folder, tmp_path):
    """SmolVLM's folders keep the template in `chat_template.json` (a processor's file), not the tokenizer's."""
    copy = tmp_path / "smolvlm"
    shutil.copytree(model_folder, copy)
    (copy / "chat_template.jinja").unlink()
    assert load_tokenizer(copy).chat_template is None
    (copy / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert load_tokenizer(copy).chat_template == TEMPLATE
