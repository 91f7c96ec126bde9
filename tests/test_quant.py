"""Weight-only int8/int4: the layers against the float reference, the decoder through the real loader,
the quantized-weight cache, and `--quant auto`'s choice."""

import safetensors.torch
import pytest
import torch
from torch import nn

from engine_builder.build import EngineOptions

from studio.startup_report import StartupReport
from engine_builder.cache import EngineCache
from studio.backends import choose_quant, load_language_model
from studio.memory_fit import weight_bytes
from pipeline.llm.model.loading import load_decoder
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.weights.config import DecoderConfig, config_from_hf
from pipeline.llm.model.decoder import Decoder
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.text.prompt import Prompt
from pipeline.llm.weights.quant import QuantLinear, dequantize, group_size, pack_int4, quantize, quantize_decoder, unpack_int4
from studio.quantized_weights import quantized_decoder

QWEN25_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "max_position_embeddings": 32768, "rope_theta": 1e6, "tie_word_embeddings": False}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_int4_packing_puts_the_even_element_in_the_low_nibble():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(q).tolist() == [[0x21, 0x0F]]
    values = torch.randint(0, 16, (8, 256), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(values)), values)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_weight_is_within_half_a_step_of_the_original(mode, dtype):
    """Round-to-nearest: every dequantized weight lies within half a quantization step (the scale) of
    the original; a wrong sign, zero point, nibble order or group layout breaks this by whole steps."""
    torch.manual_seed(0)
    w = (torch.randn(96, 512) * torch.rand(96, 1) + torch.randn(96, 1) * 0.1).to(dtype)
    parts = quantize(w, mode, dtype)
    back = dequantize(parts, mode)
    if mode == "int8":
        assert parts["q"].dtype == torch.int8 and parts["scale"].shape == (96, 1)
        step = parts["scale"].float().expand(-1, 512)
    else:
        assert parts["q"].shape == (96, 256) and parts["scale"].shape == (96, 512 // 128)
        step = parts["scale"].float().repeat_interleave(128, dim=1)
    err = (back - w.float()).abs()
    assert (err <= step * 0.5 + 1e-3 * step + 1e-7).all(), f"worst {(err / step).max():.3f} steps"
    # and the steps are as fine as the format allows: the range of a row (int8) or group (int4)
    span = w.float().abs().amax(1, keepdim=True) / 127 if mode == "int8" else \
        (w.float().view(96, 4, 128).amax(-1) - w.float().view(96, 4, 128).amin(-1)).repeat_interleave(128, 1) / 15
    assert torch.allclose(step, span.expand_as(step), rtol=1e-2)


@pytest.mark.parametrize("mode, bound", [("int8", 0.02), ("int4", 0.15)])
def test_quantized_linear_matches_the_float_layer(mode, bound):
    torch.manual_seed(1)
    linear = nn.Linear(1024, 384, bias=True)
    x = torch.randn(3, 5, 1024)
    layer = QuantLinear.from_linear(linear, mode)
    out, ref = layer(x), linear(x)
    assert out.shape == ref.shape
    err = rel_err(out, ref)
    assert err < bound, err
    # quantization noise, not a copy of the float weights: int4 is visibly coarser than int8
    assert err > (1e-3 if mode == "int8" else 2e-2)
    assert torch.equal(layer.bias, linear.bias.detach())


def test_groups_are_128_wide_where_the_width_allows_and_bad_widths_are_refused():
    assert group_size(3584) == 128 and group_size(64) == 64
    assert group_size(576) == 64  # SmolLM2's width: 4.5 groups of 128
    with pytest.raises(ValueError, match="divisible by 16"):
        group_size(200)


def _logits(model, ids):
    cache = KVCache(model.config, 1, 64, torch.float32, "cpu")
    rope = RotaryTables(model.config, 64, "cpu")
    with torch.inference_mode():
        return model(cache, rope, (Prefill(0, 0),), tokens=torch.tensor([ids]))[0]


@pytest.mark.parametrize("mode, bound", [("int8", 0.03), ("int4", 0.3)])
@pytest.mark.parametrize("demo", ["qwen2_demo", "qwen_v1_demo"])
def test_quantized_decoder_through_the_loader_stays_close_to_float(demo, mode, bound, request):
    folder = request.getfixturevalue(demo)
    ref = load_decoder(folder)
    quantized = quantized_decoder(folder, mode, torch.float32, torch.device("cpu"), None, print)
    layers = [m for m in quantized.modules() if isinstance(m, QuantLinear)]
    assert [m.mode for m in layers] == [mode] * 4 * quantized.config.num_layers + ["int8"]  # the LM head: int8
    assert layers[-1] is quantized.lm_head and isinstance(quantized.embed, nn.Embedding)
    ids = list(range(5, 45))
    err = rel_err(_logits(quantized, ids), _logits(ref, ids))
    assert 1e-4 < err < bound, err


def test_a_head_tied_to_the_embedding_stays_float_and_weight_bytes_counts_what_is_held(qwen2_demo):
    """`weight_bytes` (what the memory budget and `--quant auto` plan with) equals the bytes a quantized
    decoder holds; a tied LM head is the embedding's table and stays float with it."""
    config = read_config(qwen2_demo)
    for tied in (False, True):
        cfg = DecoderConfig(**{**config.__dict__, "tie_word_embeddings": tied})
        for mode in ("int8", "int4"):
            model = quantize_decoder(Decoder(cfg).to(torch.bfloat16), mode, "cpu")
            held = sum(t.nbytes for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
            assert isinstance(model.lm_head, nn.Linear if tied else QuantLinear)
            assert abs(weight_bytes(cfg, mode, torch.bfloat16) - held) <= 0.02 * held, (tied, mode)


def test_the_quantized_cache_is_reused_and_rebuilt_when_the_source_changes(qwen2_demo, tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    for f in qwen2_demo.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    cache = EngineCache(tmp_path / "engines")
    lines: list[str] = []
    first = quantized_decoder(src, "int4", torch.float32, torch.device("cpu"), cache, lines.append)
    assert any("quantizing to int4 (not built yet)" in line for line in lines)
    (stored,) = [p for p in (tmp_path / "engines").glob("llm-int4-*/decoder.safetensors")]
    tensors = safetensors.torch.load_file(stored)
    assert tensors["layers.0.mlp.w_down.q"].dtype == torch.uint8  # int4, two per byte, on disk
    assert "layers.0.mlp.w_down.weight" not in tensors

    lines.clear()
    again = quantized_decoder(src, "int4", torch.float32, torch.device("cpu"), cache, lines.append)
    assert lines == [f"{src.name}: int4 weights loaded from the cache in " + lines[0].rsplit(" in ", 1)[1]]
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name

    weights = src / "model.safetensors"
    state = safetensors.torch.load_file(weights)
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"] * 2
    safetensors.torch.save_file(state, weights, metadata={"format": "pt"})
    lines.clear()
    changed = quantized_decoder(src, "int4", torch.float32, torch.device("cpu"), cache, lines.append)
    assert any("quantizing to int4 (built for the weights changed)" in line for line in lines), lines
    assert not torch.equal(changed.layers[0].mlp.w_down.scale, again.layers[0].mlp.w_down.scale)
    # another mode is another entry: the int4 one stays
    quantized_decoder(src, "int8", torch.float32, torch.device("cpu"), cache, lines.append)
    assert len(list((tmp_path / "engines").glob("llm-int*-*/decoder.safetensors"))) == 2


def test_the_chat_model_loads_quantized_and_says_how_it_runs(qwen_v1_demo, tmp_path):
    options = EngineOptions(EngineCache(tmp_path / "engines"), StartupReport(out=None))
    llm = load_language_model(qwen_v1_demo, "demo/qwen-v1-tiny", quant="int8", engines=options)
    try:
        assert "int8 weights (torch's CPU low-bit kernels, in bf16)" in llm.description
        stream = llm.engine.submit(Prompt(tuple(range(3, 20))), _greedy(8), stop_ids=set())
        assert len(list(stream)) == 8
    finally:
        llm.engine.close()


def _greedy(n):
    from pipeline.llm.engine.params import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0, repetition_penalty=1.0)


def test_auto_picks_what_fits_the_memory():
    config = config_from_hf(QWEN25_7B)
    gpu, bf16 = torch.device("cuda"), torch.bfloat16
    assert 15.0e9 < weight_bytes(config, "none", bf16) < 15.5e9
    assert 8.0e9 < weight_bytes(config, "int8", bf16) < 8.3e9
    assert 4.9e9 < weight_bytes(config, "int4", bf16) < 5.3e9  # embedding in bf16 1.09 GB, LM head in int8 0.55 GB
    assert choose_quant("auto", config, bf16, gpu, 40 << 30, 8192)[0] == "none"
    assert choose_quant("auto", config, bf16, gpu, 12 << 30, 8192)[0] == "int8"
    assert choose_quant("auto", config, bf16, gpu, 8 << 30, 8192)[0] == "int4"
    mode, why = choose_quant("auto", config, bf16, torch.device("cpu"), None, 8192)
    assert mode == "none" and "CPU" in why
    assert choose_quant("int4", config, bf16, gpu, 40 << 30, 8192) == ("int4", "asked for")


def test_quantized_weights_that_compute_wrong_are_refused_and_the_float_weights_used(qwen2_demo, tmp_path):
    """The trust gate for the weights quantized here: each quantized layer must reproduce the float
    layer's output on a probe input (stored before quantizing). Stored weights changed under consistent
    metadata (one layer's nibbles swapped) are refused at the next load, the float weights run instead
    with a notice naming the check, and the verdict holds until --rebuild."""
    import json

    from engine_builder.cache import _stamp
    from pipeline.files import file_sha256
    from studio.config import parse_config
    from studio.plan import make_plan
    from studio.check import check_engines
    from studio.backends import torch_decoder

    options = EngineOptions(EngineCache(tmp_path / "engines"), StartupReport(out=None))
    model, how = torch_decoder(qwen2_demo, "demo", "int4", torch.float32, torch.device("cpu"), options)
    assert how.startswith("int4") and "verified (int4 weights against the float layers" in " ".join(options.report.lines)
    (folder,) = [p for p in (tmp_path / "engines").glob("llm-int4-*") if p.is_dir()]
    tensors = safetensors.torch.load_file(folder / "decoder.safetensors")
    q = tensors["layers.0.mlp.w_down.q"]
    tensors["layers.0.mlp.w_down.q"] = (q >> 4) | (q << 4)  # the two nibbles of every byte swapped
    safetensors.torch.save_file(tensors, folder / "decoder.safetensors", metadata={"format": "pt"})
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p), "stamp": _stamp(p)}
                     for p in sorted(folder.iterdir()) if p.name != "meta.json"}
    (folder / "meta.json").write_text(json.dumps(meta))
    for _ in range(2):  # the check refuses it; a restart keeps the verdict
        options = EngineOptions(EngineCache(tmp_path / "engines"), StartupReport(out=None))
        model, how = torch_decoder(qwen2_demo, "demo", "int4", torch.float32, torch.device("cpu"), options)
        assert how == "float32" and not any(isinstance(m, QuantLinear) for m in model.modules())
        said = " ".join(options.report.lines)
        assert "refused (int4 weights against the float layers on probe inputs: int4 layers: worst error" in said
        assert "layers.0.mlp.w_down" in said and "loading the float weights instead" in said
    args = parse_config(["--device", "cpu", "--dtype", "float32", "--weights", str(qwen2_demo), "--quant",
                               "int4", "--chat-backend", "torch", "--engine-dir", str(tmp_path / "engines")])
    (line,) = [line for line in check_engines(args, make_plan(args)) if line.startswith("chat int4")]
    assert "refused (int4 weights against the float layers" in line, line  # --check shows the verdict
    options = EngineOptions(EngineCache(tmp_path / "engines", rebuild=True), StartupReport(out=None))
    model, how = torch_decoder(qwen2_demo, "demo", "int4", torch.float32, torch.device("cpu"), options)
    assert how.startswith("int4") and "verified (" in " ".join(options.report.lines)
