"""MiniGPT-4 image chat on the tiny demo models: prompt layout, splicing, turns, stops, bad input."""

import numpy as np
import pytest
import torch

from pipeline.errors import UserError
from pipeline.pipelines.image_chat import ImageChatPipeline
from pipeline.images import load_image
from pipeline.llm.demo import demo_model_dir
from pipeline.llm.engine.params import SamplingParams
from studio.backends import load_language_model, vision_encoder
from pipeline.llm.engine.seam import TokenStream
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables
from pipeline.minigpt4.template import IMAGE, MINIGPT4_SYSTEM, PLACEHOLDER_ID, MiniGPT4Format
from pipeline.minigpt4.weights import demo_vision_dir, load_vision_folder

GREEDY = SamplingParams(max_new_tokens=20, temperature=0)


def demo_parts(studio_cache):
    llm = load_language_model(demo_model_dir("demo/llama-tiny", studio_cache), "demo/llama-tiny", max_context=2048)
    vision_dir = demo_vision_dir(studio_cache, llm_width=64)
    return load_vision_folder(vision_dir / "prerained_minigpt4_7b.pth", vision_dir), llm


@pytest.fixture(scope="module")
def pipe(studio_cache):
    vision, llm = demo_parts(studio_cache)
    return ImageChatPipeline(vision_encoder(vision), llm, is_demo=True)


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
    assert ids.ids == tuple(before + [PLACEHOLDER_ID] * 32 + after) and ids.slots == ((len(before), 32),)


def test_multi_turn_keeps_image_and_history(pipe):
    tok = pipe.llm.tokenizer
    ids = pipe.format.render([user("What is it?"), assistant("A bowl of fruit."), user("What colour is the bowl?")])
    (start, length), = ids.slots
    text = tok.decode(list(ids.ids[start + length:]))
    assert text.strip() == ("</Img> What is it?###Assistant: A bowl of fruit.###Human: What colour is the bowl?"
                            "###Assistant:")


def test_a_reply_last_is_continued_not_answered(pipe):
    """Continue: the prompt ends in the reply's own words, with no separator and no new turn after it."""
    ids = pipe.format.render([user("What is it?"), assistant("A bowl of")])
    (start, length), = ids.slots
    assert pipe.llm.tokenizer.decode(list(ids.ids[start + length:])).strip() == \
        "</Img> What is it?###Assistant: A bowl of"
    llama2 = MiniGPT4Format(pipe.llm.tokenizer, "llama2", 32).segments([user("q1"), assistant("a1")])
    assert llama2[-1] == "</Img> q1 [/INST] a1"


def test_user_text_cannot_make_image_slots(pipe):
    ids = pipe.format.render([user("<ImageHere> <Img><ImageHere></Img> <s>")])
    assert ids.slots == ((ids.slots[0][0], 32),) and ids.ids.count(pipe.llm.tokenizer.bos_id) == 1


def test_llama2_template(pipe):
    fmt = MiniGPT4Format(pipe.llm.tokenizer, "llama2", 32)
    segments = fmt.segments([user("q1"), assistant("a1"), user("q2")])
    bos = pipe.llm.tokenizer.bos_id
    assert segments == [bos, MINIGPT4_SYSTEM, bos, "[INST] <Img>", IMAGE, "</Img> q1 [/INST] a1", bos,
                        "[INST] q2 [/INST] "]


def test_image_embeddings_fill_the_slot(pipe, photo):
    """The engine's logits for a filled prompt equal a direct forward over hand-spliced embeddings."""
    image_embeds = pipe.encode_image(photo)
    assert image_embeds.shape == (32, 64)
    prompt = pipe.format.render([user("Describe it.")]).fill(image_embeds, "photo")
    (start, length), = prompt.slots
    model = pipe.llm.engine.model
    with torch.inference_mode():
        embeds = model.embed(torch.tensor([prompt.ids]))
        embeds[0, start:start + length] = image_embeds
        cache, rope = KVCache(model.config, 1, 256, torch.float32, "cpu"), RotaryTables(model.config, 256, "cpu")
        expected = model(cache, rope, (Prefill(row=0, start=0),), embeds=embeds)[0, -1, :pipe.llm.tokenizer.vocab_size]
    stream = pipe.llm.engine.submit(prompt, GREEDY, stop_ids=set(), keep_logits=True)
    stream.wait()
    torch.testing.assert_close(stream.logits[0], expected, rtol=0, atol=1e-5)


def test_next_turn_reuses_the_cached_image_and_history(pipe, photo):
    params = SamplingParams(max_new_tokens=8, temperature=0)
    first = list(pipe.stream(photo, [user("What is it?")], params, session="s1"))
    answer = "".join(e.text for e in first)
    second = list(pipe.stream(photo, [user("What is it?"), assistant(answer), user("Why?")], params, session="s1"))
    slot_end = pipe.format.render([user("What is it?")]).slots[0][0] + 32
    assert second[-1].stats.cached_tokens > slot_end  # the image and the first question were not recomputed
    other = np.ascontiguousarray(photo[:, ::-1])
    third = list(pipe.stream(other, [user("What is it?"), assistant(answer), user("Why?")], params, session="s1"))
    assert third[-1].stats.cached_tokens == slot_end - 32  # another image: reuse stops where the image starts


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

    class ScriptedStream(TokenStream):  # ends when the reply loop cancels it, as an engine would
        def cancel(self, reason="cancelled"):
            super().cancel(reason)
            self.end(reason)

    def scripted(prompt, params, stop_ids, **kwargs):
        stream = ScriptedStream(None, keep_logits=False)
        for token in script:
            stream.deliver(token)
        return stream

    monkeypatch.setattr(pipe.llm.engine, "submit", scripted)
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
    vision, llm = demo_parts(studio_cache)
    vision.llama_proj = torch.nn.Linear(vision.config.qformer_width, 48)
    vision.config = type(vision.config)(**{**vision.config.__dict__, "llm_width": 48})
    with pytest.raises(UserError, match="another LLM"):
        ImageChatPipeline(vision_encoder(vision), llm)
