"""Pre-quantized AWQ / GPTQ int4 folders: tiny checkpoints written here in each on-disk format (packed
by this file's own writer, from the formats' specifications) load as the app's int4 decoder and give
the logits of a float checkpoint holding the exactly dequantized weights (q − z)·s; settings the app
cannot run are refused by name; the repacked weights are cached like our own quantized ones."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from studio.sizes import llm_size
from engine_builder.build import EngineOptions
from studio.startup_report import StartupReport
from engine_builder.cache import EngineCache
from studio.backends import choose_quant, load_language_model, torch_decoder
from studio.memory_fit import weight_bytes
from pipeline.errors import UserError
from pipeline.llm.model.loading import load_decoder, load_prequantized
from pipeline.llm.weights.checkpoint import from_internal, layout_of, read_config, to_internal, write_checkpoint
from pipeline.llm.weights.config import CONFIG_WRITERS, config_from_hf
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.weights.quant import QuantLinear
from pipeline.llm.engine.params import SamplingParams

GROUP = 128
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble k of a word holds output AWQ_PACK_ORDER[k]
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
# quantization_config as the published folders ship it (Qwen2.5-7B-Instruct-AWQ, -GPTQ-Int4 via optimum)
AWQ = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
       "zero_point": True}
GPTQ = {"batch_size": 1, "bits": 4, "block_name_to_quantize": None, "damp_percent": 0.01, "dataset": None,
        "desc_act": False, "exllama_config": {"version": 1}, "group_size": 128, "quant_method": "gptq",
        "sym": True, "true_sequential": True, "use_exllama": True}
FAMILIES = {"qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},  # Qwen2.5-0.5B/1.5B/3B: tied head
            "llama": {"model_type": "llama", "tie_word_embeddings": False},
            # Qwen-7B-Chat-Int4's kind: fused c_attn, intermediate_size counting w1 and w2
            "qwen": {"model_type": "qwen", "intermediate_size": 512, "tie_word_embeddings": False}}


def pack_words(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """Integers 0..15 [..., 8n] → int32 words [..., n]: nibble k (bits 4k..4k+3) of word w holds value
    8w + order[k]."""
    v = values.to(torch.int64)
    words = torch.zeros(*v.shape[:-1], v.shape[-1] // 8, dtype=torch.int64)
    for k in range(8):
        words |= v[..., order[k]::8] << (4 * k)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits, as a signed int32


def write_module(tensors: dict, name: str, q, z, s, method: str, fmt: str = "gptq") -> None:
    """One linear's q [out, in], integer zeros z and scales s [out, in/GROUP] in `method`'s on-disk layout."""
    if method == "awq":
        tensors[name + "qweight"] = pack_words(q.T, AWQ_PACK_ORDER)  # [in, out/8]
        tensors[name + "qzeros"] = pack_words(z.T, AWQ_PACK_ORDER)  # [in/group, out/8]
    else:
        tensors[name + "qweight"] = pack_words(q, tuple(range(8))).T.contiguous()  # [in/8, out]
        tensors[name + "qzeros"] = pack_words(z.T - int(fmt == "gptq"), tuple(range(8)))  # v1: zero − 1
        tensors[name + "g_idx"] = (torch.arange(q.shape[1]) // GROUP).to(torch.int32)
    tensors[name + "scales"] = s.T.contiguous()  # [in/group, out], float16


def tiny_checkpoints(tmp_path, family: str, method: str, fmt: str = "gptq", zeros=(1, 16),
                     quantization: dict | None = None, vocab_size: int = 256):
    """(pre-quantized folder, float reference folder): the same random integers, packed in `method`'s
    format in the first and dequantized, (q − z)·s in float32, in the second; `fmt`: GPTQ's
    checkpoint_format (none written for "gptq", the default as Qwen's folders ship it)."""
    cfg = {**TINY, **FAMILIES[family], "vocab_size": vocab_size}
    config = config_from_hf(cfg)
    torch.manual_seed(0)
    model = Decoder(config)
    with torch.no_grad():  # spread in the norms and biases; every float exact in float16, as stored
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.2 * torch.randn_like(p))
            p.copy_(p.half().float())
    layout, fmt_name = layout_of(config), "qwen" if family == "qwen" else "hf"
    floats = {k: v.clone() for k, v in from_internal(config, model.state_dict(), layout).items()}
    packed, dequantized = {}, {}
    for i in range(config.num_layers):
        for modules in layout.projections().values():
            for m in modules:
                name = layout.layer.format(i) + m
                out, n = floats.pop(name + "weight").shape
                q = torch.randint(0, 16, (out, n))
                z = torch.randint(*zeros, (out, n // GROUP))
                s = (torch.rand(out, n // GROUP) * 0.01 + 0.002).half()
                write_module(packed, name, q, z, s, method, fmt)
                per_input = z.repeat_interleave(GROUP, 1), s.float().repeat_interleave(GROUP, 1)
                dequantized[name + "weight"] = (q - per_input[0]) * per_input[1]
    ref, folder = tmp_path / f"{family}-{method}-ref", tmp_path / f"{family}-{method}"
    write_checkpoint(ref, config, to_internal(config, {**floats, **dequantized}, layout), fmt_name)
    folder.mkdir()
    floats = {k: v.half() for k, v in floats.items()}
    save_file({**floats, **packed}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if quantization is None:
        quantization = AWQ if method == "awq" else GPTQ if fmt == "gptq" else {**GPTQ, "checkpoint_format": fmt}
    (folder / "config.json").write_text(json.dumps({**CONFIG_WRITERS[fmt_name](config), "torch_dtype": "float16",
                                                    "quantization_config": quantization}))
    return folder, ref


def reference(folder):
    """The float decoder with its LM head made int8 as `--quant` makes it (both sides then round it alike)."""
    model = load_decoder(folder)
    if not model.config.tie_word_embeddings:
        model.lm_head = QuantLinear.from_linear(model.lm_head, "int8")
    return model


def logits(model, ids):
    cache = KVCache(model.config, 1, 64, torch.float32, "cpu")
    rope = RotaryTables(model.config, 64, "cpu")
    with torch.inference_mode():
        return model(cache, rope, (Prefill(0, 0),), tokens=torch.tensor([ids]))[0]


def projections(model):
    return [getattr(getattr(block, path.split(".")[0]), path.split(".")[1]) for block in model.layers
            for path in ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")]


IDS = list(range(3, 40))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_folders_load_as_their_dequantized_weights(tmp_path, family, method):
    folder, ref_folder = tiny_checkpoints(tmp_path, family, method)
    assert read_config(folder).quantization == method
    model, ref = load_prequantized(folder, torch.float32), reference(ref_folder)
    layers = projections(model)
    assert all(isinstance(m, QuantLinear) and m.mode == "int4" for m in layers)
    for ours, theirs in zip(layers, projections(ref)):  # the repacking is exact, weight by weight
        assert torch.equal(ours.weight_float(), theirs.weight)
        assert (ours.bias is None) == (theirs.bias is None)
        assert ours.bias is None or torch.equal(ours.bias, theirs.bias)
    tied = model.config.tie_word_embeddings
    assert isinstance(model.lm_head, nn.Linear if tied else QuantLinear)
    assert tied or model.lm_head.mode == "int8"
    assert isinstance(model.embed, nn.Embedding) and model.embed.weight.dtype == torch.float32
    got, want = logits(model, IDS), logits(ref, IDS)
    assert (got - want).abs().max() < 1e-3 and want.abs().max() > 0.1


def test_gptq_v1_stores_zeros_minus_one_and_v2_as_they_are(tmp_path):
    """The same integers written as checkpoint_format gptq (AutoGPTQ: zero − 1) and gptq_v2 (the zero)
    load to the same weights; a v1 folder read as v2 is off by exactly one step (the scale) everywhere."""
    v1, ref = tiny_checkpoints(tmp_path / "v1", "llama", "gptq", "gptq", zeros=(1, 16))
    v2, _ = tiny_checkpoints(tmp_path / "v2", "llama", "gptq", "gptq_v2", zeros=(1, 16))
    a, b, want = load_prequantized(v1, torch.float32), load_prequantized(v2, torch.float32), reference(ref)
    for x, y, w in zip(projections(a), projections(b), projections(want)):
        assert torch.equal(x.weight_float(), w.weight) and torch.equal(y.weight_float(), w.weight)
    cfg = json.loads((v1 / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (v1 / "config.json").write_text(json.dumps(cfg))
    for wrong, right in zip(projections(load_prequantized(v1, torch.float32)), projections(a)):
        step = right.scale.float().repeat_interleave(GROUP, 1)
        assert torch.allclose(right.weight_float() - wrong.weight_float(), -step)


def test_a_gptq_v1_zero_of_sixteen_is_kept(tmp_path):
    """AutoGPTQ v1 stores a zero of 0 as −1 (nibble 15), read back as 16; the app's float zero holds it."""
    folder, ref = tiny_checkpoints(tmp_path, "llama", "gptq", "gptq", zeros=(16, 17))
    model = load_prequantized(folder, torch.float32)
    assert model.layers[0].mlp.w_down.zero.eq(16).all()
    for x, w in zip(projections(model), projections(reference(ref))):
        assert torch.equal(x.weight_float(), w.weight)


def test_act_order_is_refused_by_name_unless_its_groups_are_in_order(tmp_path):
    """Act-order's g_idx gives input i the group of its place in the quantization order; where that is
    i // 128 throughout (as for a layer of one group) the layout is the plain one and runs."""
    folder, ref = tiny_checkpoints(tmp_path / "a", "qwen2", "gptq", quantization={**GPTQ, "desc_act": True})
    model = load_prequantized(folder, torch.float32)
    assert (logits(model, IDS) - logits(reference(ref), IDS)).abs().max() < 1e-3
    in_order = torch.arange(TINY["intermediate_size"]) // GROUP  # down_proj: two groups
    for layer, g_idx in ((1, in_order.flip(0)), (0, in_order[torch.randperm(len(in_order))])):
        name = f"model.layers.{layer}.mlp.down_proj.g_idx"
        tensors = load_file(folder / "model.safetensors")
        tensors[name] = g_idx.to(torch.int32)
        bad = tmp_path / name.replace(".", "-")
        shutil.copytree(folder, bad)
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
        assert read_config(bad).quantization == "gptq"  # the config alone cannot tell
        with pytest.raises(UserError, match=r"desc_act \(act-order\)") as e:
            load_prequantized(bad, torch.float32)
        assert name.removesuffix("g_idx") in str(e.value) and "desc_act false" in str(e.value)


@pytest.mark.parametrize("quantization, words", [
    ({**GPTQ, "group_size": 64}, "group_size 64"),
    ({**GPTQ, "group_size": -1}, "group_size -1"),
    ({**AWQ, "group_size": 32}, "group_size 32"),
    ({**GPTQ, "bits": 8}, "bits 8"),
    ({**GPTQ, "bits": 3}, "bits 3"),
    ({**AWQ, "version": "gemv"}, "AWQ version 'gemv'"),
    ({**AWQ, "version": "exllama"}, "AWQ version 'exllama'"),
    ({**AWQ, "zero_point": False}, "zero_point false"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "bits": 8}, "quant_method 'fp8'"),
])
def test_settings_the_app_cannot_run_are_refused_by_name(tmp_path, quantization, words):
    cfg = {**TINY, **FAMILIES["llama"], "quantization_config": quantization}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=words) as e:
        read_config(tmp_path)
    assert "quantization_config" in str(e.value)


def test_a_prequantized_folder_runs_and_is_budgeted_as_int4_whatever_quant_asks(tmp_path):
    folder, _ = tiny_checkpoints(tmp_path, "llama", "awq")
    config, cpu, gpu = read_config(folder), torch.device("cpu"), torch.device("cuda")
    assert choose_quant("int4", config, torch.float16, cpu, None, 256) == ("int4", "asked for")
    int4 = weight_bytes(config, "int4", torch.float16)
    for asked in ("none", "int8", "auto"):
        mode, why = choose_quant(asked, config, torch.float16, gpu, 1 << 40, 256)
        assert mode == "int4" and f"AWQ int4 weights: it runs as int4, not --quant {asked}" in why
        assert llm_size(folder, asked, torch.float16) == int4  # the memory budget's estimate
    with pytest.raises(UserError, match="AWQ int4 weights: it loads as int4"):
        load_decoder(folder)  # the float loader


def test_the_repacked_weights_are_cached_and_read_back_on_the_next_launch(tmp_path):
    folder, _ = tiny_checkpoints(tmp_path, "qwen2", "awq")
    cache = tmp_path / "engines"

    def launch():
        options = EngineOptions(EngineCache(cache), StartupReport(out=None))
        model, how = torch_decoder(folder, "tiny-awq", "int4", torch.float32, torch.device("cpu"), options)
        return model, how, options.report.lines

    first, how, lines = launch()
    assert how == "int4 weights (torch's CPU low-bit kernels, in bf16)"
    assert any("repacking its AWQ int4 weights (not built yet)" in line for line in lines), lines
    (stored,) = cache.glob("llm-int4-awq-*/decoder.safetensors")
    assert load_file(stored)["layers.0.attn.wqkv.q"].dtype == torch.uint8  # the app's int4, on disk
    again, _, lines = launch()
    assert any("int4 weights loaded from the cache" in line for line in lines), lines
    assert not any("repacking" in line for line in lines)
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(logits(first, IDS), logits(again, IDS))


def test_the_chat_model_loads_a_gptq_folder_as_int4_and_says_so(qwen2_demo, tmp_path):
    """Through `load_language_model`, `--quant none` on a GPTQ folder: it says once that it runs as int4."""
    vocab = json.loads((qwen2_demo / "config.json").read_text())["vocab_size"]
    folder, _ = tiny_checkpoints(tmp_path, "qwen2", "gptq", vocab_size=vocab)  # the demo tokenizer's
    for f in qwen2_demo.iterdir():
        if f.name.startswith(("tokenizer", "generation")):
            shutil.copy2(f, folder / f.name)
    options = EngineOptions(EngineCache(tmp_path / "engines"), StartupReport(out=None))
    llm = load_language_model(folder, "tiny-gptq", quant="none", engines=options)
    try:
        assert "int4 weights (torch's CPU low-bit kernels, in bf16)" in llm.description
        said = [line for line in options.report.lines if "runs as int4" in line]
        assert said == ["tiny-gptq: --quant int4 (the checkpoint holds GPTQ int4 weights: it runs as int4, "
                        "not --quant none)"], options.report.lines
        params = SamplingParams(max_new_tokens=4, temperature=0, repetition_penalty=1.0)
        assert len(list(llm.engine.submit(Prompt(tuple(range(3, 20))), params, stop_ids=set()))) == 4
    finally:
        llm.engine.close()
