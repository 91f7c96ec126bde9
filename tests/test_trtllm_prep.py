"""TensorRT-LLM preparation that needs no TensorRT-LLM: the checkpoint handed to its builder for
Qwen v1, Qwen2.5 and Vicuna (names, dtypes, shapes, quantization fields, checked against the names
and fields of TensorRT-LLM v0.21's checkpoint docs and converters, written out literally here), the
build settings, and the prompt-table ids of an image prompt. The build and the runner need
TensorRT-LLM, which cannot be installed here: `test_the_runner_says_why_it_cannot_run` covers what runs."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from engine_builder import trtllm
from engine_builder.trtllm.build import build_settings
from engine_builder.trtllm.checkpoint import write_trtllm_checkpoint
from engine_builder.trtllm.prompt_table import content_id, prompt_table_input
from pipeline.llm.model.loading import load_decoder
from pipeline.llm.weights.checkpoint import read_config, read_tensors, to_internal
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.demo import demo_model_dir
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.weights.families import TRTLLM_LAYOUT
from pipeline.llm.text.tokenizer import load_tokenizer

MANDATORY = {"architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "hidden_act"}


@pytest.fixture(scope="module", params=["demo/qwen-v1-tiny", "demo/qwen2-tiny", "demo/llama-tiny"])
def model(request, tmp_path_factory):
    return request.param, demo_model_dir(request.param, tmp_path_factory.mktemp("models"))


def expected_shapes(c) -> dict[str, tuple[int, ...]]:
    """TensorRT-LLM's tensor names and shapes (docs/source/architecture/checkpoint.md, llama/convert.py)."""
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    shapes = {"transformer.vocab_embedding.weight": (c.vocab_size, c.hidden_size),
              "transformer.ln_f.weight": (c.hidden_size,), "lm_head.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"transformer.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (c.hidden_size,), p + "attention.qkv.weight": (qkv, c.hidden_size),
                       p + "attention.dense.weight": (c.hidden_size, c.num_heads * c.head_dim),
                       p + "post_layernorm.weight": (c.hidden_size,),
                       p + "mlp.fc.weight": (c.intermediate_size, c.hidden_size),
                       p + "mlp.gate.weight": (c.intermediate_size, c.hidden_size),
                       p + "mlp.proj.weight": (c.hidden_size, c.intermediate_size)})
        if c.qkv_bias:
            shapes[p + "attention.qkv.bias"] = (qkv,)
    return shapes


@pytest.mark.parametrize("quant,algo", [("none", None), ("int8", "W8A16"), ("int4", "W4A16_AWQ")])
def test_checkpoint_config_follows_the_documented_format(model, tmp_path, quant, algo):
    name, folder = model
    cfg = write_trtllm_checkpoint(folder, tmp_path, "bfloat16", quant, max_context=4096)
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    assert MANDATORY <= cfg.keys()
    c = read_config(folder)
    expected_arch = "LlamaForCausalLM" if name == "demo/llama-tiny" else "Qwen2ForCausalLM"
    assert cfg["architecture"] == expected_arch and cfg["dtype"] == "bfloat16" and cfg["hidden_act"] == "silu"
    assert cfg["position_embedding_type"] == "rope_gpt_neox" and cfg["rotary_base"] == c.rope_theta
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"],
            cfg["intermediate_size"], cfg["vocab_size"]) == (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                                                             c.intermediate_size, c.vocab_size)
    assert cfg["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    # int4 is grouped (the demo's 64-wide layers take group 64; real ones 128), written quantized by us;
    # int8's exclude_modules stays null: TensorRT-LLM's default keeps the LM head and the embedding unquantized
    grouped = quant == "int4"
    assert cfg["quantization"] == {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 64 if grouped else 128,
                                   "has_zero_point": False, "pre_quant_scale": grouped,
                                   "exclude_modules": ["lm_head"] if grouped else None}
    if name == "demo/llama-tiny":
        assert "qwen_type" not in cfg and cfg["attn_bias"] is False
    else:
        assert cfg["qwen_type"] == "qwen2" and cfg["attn_bias"] is True and cfg["use_logn_attn"] is False
    if name == "demo/qwen-v1-tiny":  # no dynamic NTK in the Qwen2 format: the engine stops at the trained length
        assert cfg["max_position_embeddings"] == min(4096, c.seq_length)


def test_checkpoint_tensors_have_the_documented_names_dtypes_and_shapes(model, tmp_path):
    name, folder = model
    write_trtllm_checkpoint(folder, tmp_path, "bfloat16", "int8", max_context=4096)
    weights = load_file(str(tmp_path / "rank0.safetensors"))
    c = read_config(folder)
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_shapes(c)
    assert all(v.dtype == torch.bfloat16 for v in weights.values())  # TensorRT-LLM quantizes them itself
    raw = read_tensors(folder, torch.bfloat16)
    if name == "demo/qwen-v1-tiny":  # Qwen v1: w2 is the gate (activated), w1 the up projection
        fc, gate, qkv = "transformer.h.0.mlp.w2.weight", "transformer.h.0.mlp.w1.weight", None
    else:
        fc, gate = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
        qkv = torch.cat([raw[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(weights["transformer.layers.0.mlp.fc.weight"], raw[fc])
    assert torch.equal(weights["transformer.layers.0.mlp.gate.weight"], raw[gate])
    if qkv is not None:
        assert torch.equal(weights["transformer.layers.0.attention.qkv.weight"], qkv)


def test_checkpoint_holds_the_same_network(model, tmp_path):
    """Read back through the same layout table, the checkpoint is the original decoder, tensor for tensor."""
    _, folder = model
    write_trtllm_checkpoint(folder, tmp_path, "float32", "none", max_context=4096)
    c = read_config(folder)
    back = to_internal(c, load_file(str(tmp_path / "rank0.safetensors")), TRTLLM_LAYOUT)
    original = load_decoder(folder).state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_image_prompt_table_ids_and_layout():
    """MiniGPT-4 shows 32 query embeddings per image: ids vocab_size + row, rows once per image."""
    vocab, hidden = 1000, 8
    config = dataclasses.replace(QWEN7B, vocab_size=vocab)
    cat, dog = torch.randn(32, hidden), torch.randn(32, hidden)
    ids = tuple(range(1, 101))
    prompt = Prompt(ids, slots=((3, 32), (60, 32)), embeds=(cat, cat), keys=("cat", "cat"))
    table = prompt_table_input(prompt, config, torch.float16)
    assert table.ids[:3] == [1, 2, 3] and table.ids[3:35] == list(range(1000, 1032)) and table.ids[35:60] == list(ids[35:60])
    assert table.ids[60:92] == list(range(1000, 1032)) and table.ids[92:] == list(ids[92:])
    assert table.table.shape == (32, hidden) and table.table.dtype == torch.float16
    assert torch.equal(table.table, cat.half())
    assert table.extra_ids[3:35] == [content_id("cat")] * 32 and set(table.extra_ids[:3] + table.extra_ids[35:60]) == {0}
    two = prompt_table_input(Prompt(ids, ((3, 32), (60, 32)), (cat, dog), ("cat", "dog")), config, torch.float32)
    assert two.ids[60:92] == list(range(1032, 1064)) and torch.equal(two.table, torch.cat([cat, dog]))
    assert content_id("cat") != content_id("dog") and content_id("cat") > 0
    plain = prompt_table_input(Prompt(ids), config, torch.float16)
    assert plain.ids == list(ids) and plain.table is None and plain.extra_ids is None


QWEN7B = DecoderConfig("qwen", vocab_size=151936, hidden_size=4096, intermediate_size=11008, num_layers=32,
                       num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=8192)


@pytest.mark.parametrize("case", ["demo llama", "qwen-7b sizes"])
def test_prompt_table_ids_start_at_the_models_vocabulary_not_the_tokenizers(case, llama_demo):
    """TensorRT-LLM reads the table for ids ≥ the embedding's row count: a tokenizer smaller than the
    embedding (the demo LLaMA: 898 of 960 rows; Qwen-7B: 151,851 of 151,936) must not set the base, or
    the image rows would land on padding rows of the embedding."""
    if case == "demo llama":
        config, tokenizer_size = read_config(llama_demo), load_tokenizer(llama_demo).vocab_size
    else:
        config, tokenizer_size = QWEN7B, 151851
    assert tokenizer_size < config.vocab_size
    image = torch.randn(32, 8)
    table = prompt_table_input(Prompt(tuple(range(1, 41)), ((4, 32),), (image,), ("img",)), config, torch.float16)
    assert table.ids[4:36] == list(range(config.vocab_size, config.vocab_size + 32))


def test_build_settings_size_the_prompt_table_for_image_chat():
    settings = build_settings(max_batch=8, context=2048, image_queries=32)
    assert settings["max_prompt_embedding_table_size"] == 8 * 32
    assert (settings["max_batch_size"], settings["max_input_len"], settings["max_seq_len"]) == (8, 2047, 2048)
    assert settings["plugin_config"]["paged_kv_cache"] and settings["plugin_config"]["remove_input_padding"]
    assert build_settings(4, 8192)["max_prompt_embedding_table_size"] == 0


def test_the_runner_says_why_it_cannot_run(qwen2_demo, tmp_path):
    """Here TensorRT-LLM is absent. The runner class itself refuses to start with the reason
    (`unavailable`: TensorRT-LLM does not import, see requirements-tensorrt.txt), not a bare
    ModuleNotFoundError; and a launch with --backend tensorrt prints that reason through the runner's
    loader and answers on torch."""
    from engine_builder.build import EngineOptions
    from studio.startup_report import StartupReport
    from engine_builder.cache import EngineBuildError, EngineCache
    from engine_builder.trtllm.engine import TrtLlmEngine
    from pipeline.llm.engine.torch_engine import TorchLLMEngine
    from studio.backends import load_language_model

    reason = trtllm.unavailable()
    assert reason is not None and reason.startswith("TensorRT-LLM does not import") \
        and "requirements-tensorrt.txt" in reason
    with pytest.raises(EngineBuildError) as refused:
        TrtLlmEngine(tmp_path, read_config(qwen2_demo), 256, "float32", 1, "no engine")
    assert str(refused.value) == reason

    report = StartupReport(out=None)
    llm = load_language_model(qwen2_demo, "demo/qwen2-tiny", backend="tensorrt", max_context=256, max_batch=1,
                              engines=EngineOptions(EngineCache(tmp_path / "engines"), report))
    assert f"demo/qwen2-tiny: the TensorRT-LLM engine failed ({reason}); running on torch instead" in report.lines
    assert isinstance(llm.engine, TorchLLMEngine)
    llm.engine.close()


def test_responses_reach_the_stream_as_the_torch_engine_delivers_them():
    """The runner's bookkeeping (no executor involved): tokens stream, a stop id ends the reply unsent,
    the executor's final response ends it with its reason."""
    from engine_builder.trtllm.engine import _Request
    from pipeline.llm.engine.seam import TokenStream

    request = _Request(TokenStream(None, False), stop_ids={7}, submitted=0.0)
    assert not request.take([3, 4], None) and request.take([5, 7, 9], None)
    assert list(request.stream) == [3, 4, 5] and request.stream.stats.finish_reason == "stop"
    assert request.stream.stats.new_tokens == 3
    ended = _Request(TokenStream(None, False), stop_ids=set(), submitted=0.0)
    assert ended.take([1], "length") and list(ended.stream) == [1]
    assert ended.stream.stats.finish_reason == "length"


@pytest.mark.parametrize("shared", [True, False])
def test_a_chat_llm_shared_with_image_chat_is_built_with_a_prompt_table(shared, studio_cache, qwen2_demo,
                                                                        monkeypatch):
    """When image chat names the chat's own weights it runs on the chat's LLM, so that LLM's engine
    must take image embeddings (a TensorRT-LLM engine built without a prompt table would drop them)."""
    from pipeline.minigpt4.weights import demo_parts
    from pipeline.service.tools import ToolHost
    from studio import compose
    from studio.config import parse_config
    from studio.plan import make_plan

    ckpt, vision_dir, llm_dir = demo_parts(studio_cache)
    args = parse_config(["--device", "cpu", "--weights", str(llm_dir if shared else qwen2_demo),
                         "--minigpt4-ckpt", str(ckpt), "--minigpt4-vision", str(vision_dir),
                         "--minigpt4-llm", str(llm_dir)])
    plan = make_plan(args)
    asked = []

    def record(*a, **kw):
        asked.append(kw["image_queries"])
        raise RuntimeError("recorded")

    monkeypatch.setattr(compose, "load_language_model", record)  # what the chat's loader calls
    host = ToolHost(torch.device("cpu"), None, lambda line: None)
    specs = {s.name: s for s in compose.tool_specs(args, plan, compose.engine_options(args, out=None), host)}
    assert specs["image chat"].needs == (("chat",) if shared else ())
    with pytest.raises(RuntimeError, match="recorded"):
        specs["chat"].load(lambda line: None, None)
    assert asked == [compose.IMAGE_QUERIES if shared else 0]


def unpack_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float weight [out, in] behind a `W4A16_AWQ` linear, read as ModelOpt's exporter documents the
    layout (written out here from that description, not from our packer): bytes [out/2, in], the even
    output row in the low nibble as a signed 4-bit value, one scale per (row, group of inputs)."""
    bytes_ = packed.view(torch.uint8).to(torch.int16)
    low, high = bytes_ & 0x0F, bytes_ >> 4
    low, high = torch.where(low >= 8, low - 16, low), torch.where(high >= 8, high - 16, high)
    q = torch.stack([low, high], dim=1).reshape(packed.shape[0] * 2, packed.shape[1]).float()
    group = q.shape[1] // scale.shape[1]
    return q * scale.float().repeat_interleave(group, dim=1)


def test_int4_linears_are_written_grouped_in_the_awq_layout(model, tmp_path):
    """`--quant int4` on TensorRT-LLM: every linear is grouped int4 (not per-channel `W4A16`), and reads
    back within half a quantization step of the float weights; the LM head and embedding stay float."""
    _, folder = model
    (tmp_path / "float").mkdir()
    write_trtllm_checkpoint(folder, tmp_path / "float", "float32", "none", max_context=4096)
    floats = load_file(str(tmp_path / "float" / "rank0.safetensors"))
    cfg = write_trtllm_checkpoint(folder, tmp_path, "float32", "int4", max_context=4096)
    weights = load_file(str(tmp_path / "rank0.safetensors"))
    c, group = read_config(folder), cfg["quantization"]["group_size"]
    for name, shape in expected_shapes(c).items():
        if not name.endswith(("qkv.weight", "dense.weight", "fc.weight", "gate.weight", "proj.weight")):
            assert weights[name].dtype == torch.float32 and tuple(weights[name].shape) == shape
            continue
        out_features, in_features = shape
        packed, scale = weights[name], weights[name.replace("weight", "weights_scaling_factor")]
        assert packed.dtype == torch.int8 and tuple(packed.shape) == (out_features // 2, in_features)
        assert tuple(scale.shape) == (out_features, in_features // group)
        assert torch.equal(weights[name.replace("weight", "prequant_scaling_factor")], torch.ones(in_features))
        error = (unpack_int4(packed, scale) - floats[name]).abs()
        assert (error <= scale.repeat_interleave(group, dim=1) / 2 + 1e-6).all(), name

