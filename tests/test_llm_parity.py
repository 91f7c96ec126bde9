"""Our decoder against transformers on the same random weights (tiny configs, fp32)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipeline.llm.model.loading import load_decoder  # noqa: E402
from pipeline.llm.weights.checkpoint import (convert_qwen_v1_to_hf, read_config, read_tensors,  # noqa: E402
                                             to_internal, write_checkpoint)
from pipeline.llm.weights.families import HF_LAYOUT  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.model.kv_cache import KVCache  # noqa: E402
from pipeline.llm.model.parts import Prefill, Rows
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=3, max_position_embeddings=512)
CASES = {
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                              tie_word_embeddings=False, rope_theta=1e6),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                              tie_word_embeddings=True, rope_theta=1e6),
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4,
                                              tie_word_embeddings=False),
}
ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def random_hf_model(kind: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = CASES[kind]()
    for k, v in overrides.items():
        setattr(config, k, v)
    model = getattr(transformers, ARCH[kind])(config).eval()
    with torch.no_grad():  # trained-like spread: biases and norms that are not all 0 / 1
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "embed" in name:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_checkpoint(request, tmp_path_factory):
    kind = request.param
    model = random_hf_model(kind)
    folder = tmp_path_factory.mktemp(kind)
    model.save_pretrained(folder, max_shard_size="200KB")  # sharded, with an index, like real checkpoints
    return kind, model, folder


def cache_for(model, max_seq: int = 128) -> tuple[KVCache, RotaryTables]:
    return KVCache(model.config, 1, max_seq, torch.float32, "cpu"), RotaryTables(model.config, max_seq, "cpu")


def our_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    ours = load_decoder(folder)
    with torch.inference_mode():
        return ours(*cache_for(ours), (Prefill(row=0, start=0),), tokens=ids)


def test_checkpoint_is_sharded(hf_checkpoint):
    _, _, folder = hf_checkpoint
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1


def test_logits_match_transformers(hf_checkpoint):
    kind, model, folder = hf_checkpoint
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(ids).logits
    assert rel_err(our_logits(folder, ids), ref) <= 1e-4


def test_greedy_tokens_match_transformers_for_32_steps(hf_checkpoint):
    kind, model, folder = hf_checkpoint
    prompt = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        # A repetition penalty (same rule in both) keeps random tiny models from repeating one token.
        ref = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, repetition_penalty=1.3,
                             eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    engine = TorchLLMEngine(load_decoder(folder), context=64, vocab_size=320)
    ours = list(engine.submit(Prompt(tuple(prompt[0].tolist())),
                              SamplingParams(max_new_tokens=32, temperature=0, repetition_penalty=1.3), stop_ids=set()))
    engine.close()
    assert ours == ref
    if not model.config.tie_word_embeddings:  # a tied random model echoes its own input token forever
        assert len(set(ours)) > 3  # a real sequence, not one token repeated


def test_cached_decoding_matches_full_forward(hf_checkpoint):
    """Prefill + one-token steps through the static cache give the logits of one full pass."""
    _, _, folder = hf_checkpoint
    ids = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(3))
    full = our_logits(folder, ids)
    model = load_decoder(folder)
    cache, rope = cache_for(model, 64)
    one = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        steps = [model(cache, rope, (Prefill(row=0, start=0),), tokens=ids[:, :8])]
        steps += [model(cache, rope, (Rows(one + t, one, kv_len=t + 1),), tokens=ids[:, t:t + 1])
                  for t in range(8, 20)]
    assert rel_err(torch.cat(steps, dim=1), full) <= 1e-5


def test_bin_checkpoint_loads(tmp_path):
    model = random_hf_model("qwen2", seed=5)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    model.config.save_pretrained(tmp_path)
    ids = torch.randint(0, 320, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ref = model(ids).logits
    assert rel_err(our_logits(tmp_path, ids), ref) <= 1e-4


def test_qwen_v1_checkpoint_from_qwen2_gives_same_logits(tmp_path):
    model = random_hf_model("qwen2", seed=7, num_key_value_heads=4)  # MHA with qkv bias: Qwen v1's shape
    qwen2_dir = tmp_path / "qwen2"
    model.save_pretrained(qwen2_dir)
    config = read_config(qwen2_dir)
    v1_config = type(config)(**{**config.to_dict(), "family": "qwen", "seq_length": 512,
                                "logn_attn": True, "dynamic_ntk": True, "max_position_embeddings": 32768})
    write_checkpoint(tmp_path / "qwen_v1", v1_config, to_internal(config, read_tensors(qwen2_dir), HF_LAYOUT), "qwen")
    keys = set(read_tensors(tmp_path / "qwen_v1"))
    assert "transformer.h.0.attn.c_attn.weight" in keys and "transformer.h.0.mlp.w2.weight" in keys
    assert read_config(tmp_path / "qwen_v1").family == "qwen"
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        ref = model(ids).logits
    assert rel_err(our_logits(tmp_path / "qwen_v1", ids), ref) <= 1e-4


def test_qwen_v1_converts_to_qwen2_format(tmp_path, qwen_v1_demo):
    convert_qwen_v1_to_hf(qwen_v1_demo, tmp_path / "as_qwen2")
    assert (tmp_path / "as_qwen2" / "qwen.tiktoken").is_file()
    ref_model = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "as_qwen2").eval()
    ids = torch.randint(0, 600, (1, 16), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        ref = ref_model(ids).logits
    assert rel_err(our_logits(qwen_v1_demo, ids), ref) <= 1e-4


class OpenAIPenalties:
    """The reference: OpenAI's presence and frequency penalties as their documentation states them,
    token by token over the tokens generated so far (the prompt's do not count), as a transformers
    logits processor."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            generated = ids[self.prompt_len:]
            for token in set(generated):
                scores[row, token] -= generated.count(token) * self.frequency + self.presence
        return scores


def greedy_with_and_without(hf_checkpoint, processor, **sampling) -> None:
    """32 greedy tokens: transformers with `processor` against our engine with `sampling`, which must
    change the reply; a row without `sampling` decoding beside it is unchanged."""
    kind, model, folder = hf_checkpoint
    if kind != "qwen2":
        pytest.skip("one model is enough: sampling settings do not depend on the architecture")
    prompt = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                             pad_token_id=0, logits_processor=[processor])[0, 12:].tolist()
        plain = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, 12:].tolist()
    assert ref != plain  # the setting changes this reply
    engine = TorchLLMEngine(load_decoder(folder), context=64, vocab_size=320, max_batch=2)
    params = SamplingParams(max_new_tokens=32, temperature=0, repetition_penalty=1.0, **sampling)
    changed = engine.submit(Prompt(tuple(prompt[0].tolist())), params, stop_ids=set())
    alone = engine.submit(Prompt(tuple(prompt[0].tolist()) + (7,)), SamplingParams(
        max_new_tokens=32, temperature=0, repetition_penalty=1.0), stop_ids=set())  # a row without, beside it
    ours, other = list(changed), list(alone)
    engine.close()
    assert ours == ref
    engine = TorchLLMEngine(load_decoder(folder), context=64, vocab_size=320, max_batch=2)
    by_itself = list(engine.submit(Prompt(tuple(prompt[0].tolist()) + (7,)), SamplingParams(
        max_new_tokens=32, temperature=0, repetition_penalty=1.0), stop_ids=set()))
    engine.close()
    assert other == by_itself  # the row beside it is unchanged


@pytest.mark.parametrize("presence, frequency", [(0.8, 0.0), (0.0, 0.6), (1.5, -0.4)])
def test_presence_and_frequency_penalties_match_a_reference_over_32_greedy_steps(hf_checkpoint, presence, frequency):
    greedy_with_and_without(hf_checkpoint, OpenAIPenalties(12, presence, frequency), presence_penalty=presence,
                            frequency_penalty=frequency)


def test_logit_bias_matches_transformers_sequence_bias_over_32_greedy_steps(hf_checkpoint):
    bias = {5: 3.0, 17: -100.0, 200: 1.5, 311: 2.25}
    greedy_with_and_without(hf_checkpoint, transformers.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]),
                            logit_bias=tuple(bias.items()))
