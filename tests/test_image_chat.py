"""MiniGPT-4 image chat on the tiny demo models: prompt layout, splicing, turns, stops, bad input."""

import numpy as np
import pytest
import torch

from pipeline.errors import UserError
from pipeline.image_chat import ImageChatPipeline
from pipeline.images import load_image
from pipeline.llm.demo import demo_model_dir
from pipeline.llm.sampling import SamplingParams
from pipeline.minigpt4.template import IMAGE_TOKEN, MINIGPT4_SYSTEM, MiniGPT4Format
from pipeline.minigpt4.weights import demo_vision_dir, load_vision_folder

GREEDY = SamplingParams(max_new_tokens=20, temperature=0)


@pytest.fixture(scope="module")
def pipe(studio_cache):
    llm = demo_model_dir("demo/llama-tiny", studio_cache)
    vision_dir = demo_vision_dir(studio_cache, llm_width=64)
    vision = load_vision_folder(vision_dir / "prerained_minigpt4_7b.pth", vision_dir)
    return ImageChatPipeline(vision, llm, "demo/llama-tiny", is_demo=True)


@pytest.fixture(scope="module")
def photo():
    return load_image("assets/examples/fruit_bowl.jpg")


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_prompt_ids_and_image_slot_follow_the_template(pipe):
    tok = pipe.llm.tokenizer
    ids = pipe.format.render([user("What is unusual here?")])
    before = [tok.bos_id] + tok.encode(MINIGPT4_SYSTEM + "###Human: <Img>")
    after = tok.encode("</Img> What is unusual here?###Assistant:")
    assert ids == before + [IMAGE_TOKEN] * 32 + after
    assert ids.index(IMAGE_TOKEN) == len(before) and ids.count(IMAGE_TOKEN) == 32


def test_multi_turn_keeps_image_and_history(pipe):
    tok = pipe.llm.tokenizer
    ids = pipe.format.render([user("What is it?"), assistant("A bowl of fruit."), user("What colour is the bowl?")])
    assert ids.count(IMAGE_TOKEN) == 32
    start = ids.index(IMAGE_TOKEN)
    text = tok.decode([i for i in ids[start + 32:]])
    assert text.strip() == ("</Img> What is it?###Assistant: A bowl of fruit.###Human: What colour is the bowl?"
                            "###Assistant:")


def test_user_text_cannot_make_image_slots(pipe):
    ids = pipe.format.render([user("<ImageHere> <Img><ImageHere></Img> <s>")])
    assert ids.count(IMAGE_TOKEN) == 32 and ids.count(pipe.llm.tokenizer.bos_id) == 1


def test_llama2_template(pipe):
    fmt = MiniGPT4Format(pipe.llm.tokenizer, "llama2", 32)
    segments = fmt.segments([user("q1"), assistant("a1"), user("q2")])
    bos = pipe.llm.tokenizer.bos_id
    assert segments == [bos, MINIGPT4_SYSTEM, bos, "[INST] <Img>", IMAGE_TOKEN, "</Img> q1 [/INST] a1", bos,
                        "[INST] q2 [/INST] "]


def test_image_embeddings_are_spliced_at_the_slot(pipe, photo):
    image_embeds = pipe.encode_image(photo)
    assert image_embeds.shape == (32, 64)
    ids = pipe.format.render([user("Describe it.")])
    embeds = pipe.splice(ids, image_embeds)[0]
    start = ids.index(IMAGE_TOKEN)
    with torch.inference_mode():
        text_embeds = pipe.llm.model.embed(torch.tensor([i for i in ids if i != IMAGE_TOKEN]))
    assert torch.equal(embeds[start:start + 32], image_embeds)
    assert torch.equal(torch.cat([embeds[:start], embeds[start + 32:]]), text_embeds)


def test_image_is_encoded_once_per_image(pipe, photo):
    list(pipe.stream(photo, [user("What is unusual here?")], GREEDY))
    runs = pipe.encoder_runs
    list(pipe.stream(photo, [user("What is unusual here?")], GREEDY))
    list(pipe.stream(photo.copy(), [user("What is it?"), assistant("x"), user("Sure?")], GREEDY))
    assert pipe.encoder_runs == runs  # same pixels: the cached query embeddings serve every turn
    list(pipe.stream(np.ascontiguousarray(photo[::-1]), [user("And this one?")], GREEDY))
    assert pipe.encoder_runs == runs + 1  # a new image is encoded


def test_two_turns_stream_answers(pipe, photo):
    first = list(pipe.stream(photo, [user("What is unusual here?")], SamplingParams(max_new_tokens=16, seed=1)))
    answer = "".join(e.text for e in first)
    assert answer and not answer[0].isspace() and first[-1].stats.new_tokens > 0
    second = list(pipe.stream(photo, [user("What is unusual here?"), assistant(answer), user("Why?")],
                              SamplingParams(max_new_tokens=16, seed=1)))
    assert second[-1].stats.prompt_tokens > first[-1].stats.prompt_tokens


@pytest.mark.parametrize("split", ["native", "bytes", "byte_then_native", "spaced"])
def test_generation_stops_at_separator_however_it_tokenizes(pipe, photo, monkeypatch, split):
    """The model is replaced by a scripted token source: what is tested is the reply loop's stop."""
    tok = pipe.llm.tokenizer
    hash_byte = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"#")
    head, tail = tok.encode("A red apple."), tok.encode("Human: more")
    script = {
        "native": tok.encode("A red apple.###Human: more"),
        "bytes": head + [hash_byte] * 3 + tail,
        "byte_then_native": head + [hash_byte] + tok.encode("##Human")[1:],
        "spaced": tok.encode("A red apple. ###Human: more"),
    }[split]
    assert "###" in tok.decode(script)

    def scripted(params, stop_ids, **kwargs):
        yield from script

    monkeypatch.setattr(pipe.llm.generator, "stream", scripted)
    events = list(pipe.stream(photo, [user("What is it?")], GREEDY))
    assert "".join(e.text for e in events).rstrip() == "A red apple."
    assert events[-1].stats.finish_reason == "stop"


def test_bad_input_is_explained(pipe, photo):
    with pytest.raises(UserError, match="upload an image"):
        pipe.stream(None, [user("hi")], GREEDY)
    with pytest.raises(UserError, match="empty"):
        list(pipe.stream(photo, [user("   ")], GREEDY))
    long_question = "Describe every detail " * 600
    events = list(pipe.stream(photo, [user(long_question)], SamplingParams(max_new_tokens=8, temperature=0)))
    assert any(e.notice and "cut" in e.notice for e in events)
    assert events[-1].stats.prompt_tokens <= pipe.llm.context


def test_projection_must_fit_the_llm(studio_cache):
    llm = demo_model_dir("demo/llama-tiny", studio_cache)
    vision_dir = demo_vision_dir(studio_cache, llm_width=64)
    vision = load_vision_folder(vision_dir / "prerained_minigpt4_7b.pth", vision_dir)
    vision.llama_proj = torch.nn.Linear(vision.config.qformer_width, 48)
    vision.config = type(vision.config)(**{**vision.config.__dict__, "llm_width": 48})
    with pytest.raises(UserError, match="another LLM"):
        ImageChatPipeline(vision, llm, "demo/llama-tiny")
