"""GGUF files as llama.cpp's quantizer writes them, not only as we do: its standard mixes, with its per-tensor
rules, and headers that disagree with their tensors.

llama.cpp's mixes (`llama-quantize`'s Q4_K_M and friends) are not one type: each has a base type, gives some
tensors more bits (attn_v and ffn_down in the first and last eighth of the layers and every third between,
the output layer), and stores a tensor whose rows are not a multiple of 256 (the K and IQ types' block) in a
fallback type: Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, Q2_K/Q3_K/IQ4_XS and the other IQ types → IQ4_NL. In
Qwen2.5-0.5B's Q4_K_M that is 133 of 291 tensors (every 896-wide matrix, the embedding too), which the app
refused. The tiny models here are 384 wide (1.5 blocks of 256) with a 512-wide MLP, so both kinds of row
occur; each file's logits must equal transformers' on the same file (its loader dequantizes with the gguf
package: the library's own dequantization is the reference)."""

import json
import urllib.request

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from conftest import launched
from pipeline.errors import UserError
from pipeline.llm.weights import gguf_file
from pipeline.llm.weights.checkpoint import read_config
from pipeline.models import locate
from test_gguf import IDS, _patched, _value_at, add_vocab, bpe_vocab, cache, encode, our_logits  # noqa: F401

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 384, 512, 8, 6, 2
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL"}
# mix → (base type, the "more bits" type of attn_v/ffn_down, attn_output's type, the output layer's type)
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K", "Q4_K", "Q6_K"), "Q4_K_S": ("Q4_K", "Q5_K", "Q4_K", "Q6_K"),
         "Q5_K_M": ("Q5_K", "Q6_K", "Q5_K", "Q6_K"), "Q3_K_M": ("Q3_K", "Q5_K", "Q4_K", "Q6_K"),
         "Q2_K": ("Q2_K", "Q4_K", "Q3_K", "Q6_K"), "Q6_K": ("Q6_K", "Q6_K", "Q6_K", "Q6_K"),
         "Q8_0": ("Q8_0", "Q8_0", "Q8_0", "Q8_0"), "IQ4_XS": ("IQ4_XS", "IQ4_XS", "IQ4_XS", "Q6_K")}
FILE_TYPE = {"Q4_K_M": 15, "Q4_K_S": 14, "Q5_K_M": 17, "Q3_K_M": 12, "Q2_K": 10, "Q6_K": 18, "Q8_0": 7, "IQ4_XS": 30}


def more_bits(layer: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third between."""
    return layer < LAYERS // 8 or layer >= 7 * LAYERS // 8 or (layer - LAYERS // 8) % 3 == 2


def tensor_type(mix: str, part: str, layer: int | None, cols: int) -> str:
    base, more, attn_output, output = MIXES[mix]
    kind = {"attn_output": attn_output, "output": output}.get(part, base)
    if part in ("attn_v", "ffn_down") and layer is not None and more_bits(layer):
        kind = more
    return FALLBACK.get(kind, kind) if cols % 256 else kind


def write_mix(path, vocab: dict, mix: str, **header) -> dict[str, str]:
    """A LLaMA model in llama.cpp's `mix`; `header` overrides metadata values. Returns each tensor's type."""
    rng = np.random.default_rng(len(mix))
    w = GGUFWriter(path, "llama")
    w.add_file_type(FILE_TYPE[mix])
    values = {"context_length": 512, "embedding_length": HIDDEN, "block_count": LAYERS, "feed_forward_length": FFN,
              "head_count": HEADS, "head_count_kv": KV_HEADS} | header
    for key, value in values.items():
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    add_vocab(w, vocab)
    types = {}

    def weight(name: str, part: str, layer: int | None, rows: int, cols: int) -> None:
        types[name] = tensor_type(mix, part, layer, cols)
        data, raw = encode((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), types[name], rng)
        w.add_tensor(name, data, raw_dtype=raw)

    head_dim = HIDDEN // HEADS
    weight("token_embd.weight", "token_embd", None, len(vocab["tokens"]), HIDDEN)
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
        for part, heads in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)):
            rows = heads * head_dim
            weight(p + part + ".weight", part, i, rows, HIDDEN)
        weight(p + "attn_output.weight", "attn_output", i, HIDDEN, HEADS * head_dim)
        w.add_tensor(p + "ffn_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
        weight(p + "ffn_gate.weight", "ffn_gate", i, FFN, HIDDEN)
        weight(p + "ffn_up.weight", "ffn_up", i, FFN, HIDDEN)
        weight(p + "ffn_down.weight", "ffn_down", i, HIDDEN, FFN)
    w.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    weight("output.weight", "output", None, len(vocab["tokens"]), HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


@pytest.mark.parametrize("mix", MIXES)
def test_each_standard_mix_loads_and_gives_the_logits_of_transformers(tmp_path, bpe_vocab, mix):
    path = tmp_path / f"tiny-{mix}.gguf"
    types = write_mix(path, bpe_vocab, mix)
    stored = {t.name: GGMLQuantizationType(t.tensor_type).name for t in GGUFReader(path).tensors}
    assert {n: stored[n] for n in types} == types  # the file holds the mix as llama.cpp makes it
    if mix != "Q8_0":  # 384-wide rows took the fallback type, 512-wide ones the mix's own
        assert types["token_embd.weight"] == FALLBACK[MIXES[mix][0]] != types["blk.0.ffn_down.weight"]
    found = locate(str(path))
    assert read_config(found.path).gguf_type == mix
    got = our_logits(found.path, IDS)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    with torch.inference_mode():
        want = ref.eval()(torch.tensor([IDS])).logits[0]
    assert want.std() > 0.1
    assert ((got - want).norm() / want.norm()).item() <= 1e-4


HOSTILE = {  # header value → what the one line says
    ("block_count", 1_000_000): r"llama\.block_count says 1000000 layers, but its tensors hold 8 \(blk\.0 … blk\.7\)",
    ("block_count", 3_000): r"llama\.block_count says 3000 layers",
    ("attention.head_count", 0): r"llama\.attention\.head_count 0 and head_count_kv 2 must be positive",
    ("attention.head_count_kv", 0): r"llama\.attention\.head_count 6 and head_count_kv 0 must be positive",
    ("embedding_length", 320): r"llama\.embedding_length says 320, but token_embd\.weight is \[\d+, 384\]",
    ("attention.head_count_kv", 3):
        r"tensor blk\.0\.attn_k\.weight is \[128, 384\], but the header .* makes it \[192, 384\]",
    ("feed_forward_length", 1024): r"tensor blk\.0\.ffn_gate\.weight is \[512, 384\], .* makes it \[1024, 384\]",
}


@pytest.mark.parametrize("key, value", HOSTILE)
def test_a_header_that_disagrees_with_the_tensors_is_one_line_before_any_tensor_is_read(
        tmp_path, bpe_vocab, monkeypatch, key, value):
    """The header is patched in the file's bytes (as a hostile file would be), not written by the writer."""
    path = tmp_path / "good.gguf"
    write_mix(path, bpe_vocab, "Q4_K_M")
    reader = GGUFReader(path)
    hostile = tmp_path / f"hostile-{key}.gguf"
    hostile.write_bytes(_patched(path.read_bytes(), _value_at(reader, f"llama.{key}"), "<I", value))

    def no_reading(*args, **kwargs):
        raise AssertionError("a tensor was dequantized before the header was checked")

    monkeypatch.setattr(gguf_file, "dequantize", no_reading)
    with pytest.raises(UserError, match=HOSTILE[(key, value)]) as refused:
        locate(str(hostile))
    assert "\n" not in str(refused.value) and "a damaged or hand-edited header" in str(refused.value)


def test_a_q4_k_m_file_with_q5_0_rows_is_served_through_v1(tmp_path, bpe_vocab, studio_cache):
    path = tmp_path / "tiny-Q4_K_M.gguf"
    types = write_mix(path, bpe_vocab, "Q4_K_M")
    assert "Q5_0" in types.values() and "Q6_K" in types.values() and "Q4_K" in types.values()
    with launched(tmp_path / "served.log", studio_cache, "--model", str(path), "--context", "1024") as app:
        body = json.dumps({"model": path.name, "temperature": 0, "max_tokens": 8,
                           "messages": [{"role": "user", "content": "Hello"}]}).encode()
        with urllib.request.urlopen(urllib.request.Request(app.url + "v1/models"), timeout=60) as r:
            model = json.load(r)["data"][0]["id"]
        request = urllib.request.Request(app.url + "v1/chat/completions", body.replace(path.name.encode(),
                                                                                        model.encode()),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.load(r)
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["message"]["content"]
    assert "Q4_K_M" in app.log.read_text()


def test_what_a_gguf_file_runs_as_follows_its_types_and_check_says_so(tmp_path, bpe_vocab, capsys):
    """On a GPU (`--quant auto`): 4-bit blocks of 32 as int4 (kept as they are), a mix of types with kernels as
    stored, int8 where it cannot run so (re-rounding a real Q4_K_M into int4 cost +9.25 % perplexity) or where a
    type has no kernel; asked, int4 and gguf all the same; on the CPU as stored on ONNX Runtime where every type has
    a form there, else float."""
    from pipeline.llm.model.kv_cache import KVCache
    from studio.backends import choose_quant
    from studio.memory_fit import weight_bytes
    from studio.compose import run
    from test_gguf import write_model

    mixed = tmp_path / "mixed" / "tiny-Q4_K_M.gguf"
    mixed.parent.mkdir()
    write_mix(mixed, bpe_vocab, "Q4_K_M")
    pure = write_model(tmp_path / "tiny-Q4_0.gguf", bpe_vocab, kind="Q4_0")
    gpu, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    mix_config, pure_config = (read_config(locate(str(p)).path) for p in (mixed, pure))
    assert mix_config.gguf_tensor_types == ("Q4_K", "Q5_0", "Q6_K", "Q8_0")
    mode, why = choose_quant("auto", mix_config, bf16, gpu, 40 << 30, 1024)  # as the file stores it
    assert mode == "gguf" and "its Q4_K, Q5_0, Q6_K, Q8_0 blocks run as the file stores them" in why
    kv = KVCache.row_bytes(mix_config, 1025, bf16)
    as_stored = weight_bytes(mix_config, "gguf", bf16)
    assert as_stored < weight_bytes(mix_config, "int8", bf16)
    assert choose_quant("auto", mix_config, bf16, gpu, as_stored + kv, 1024)[0] == "gguf"  # int8 would not fit
    mode, why = choose_quant("auto", mix_config, torch.float32, gpu, 40 << 30, 1024)  # float32: no GGUF kernel
    assert mode == "int8" and "as stored it cannot run here (the low-bit kernels compute in bf16 or fp16" in why
    assert "int8 carries its weights within 0.1 % of their perplexity" in why
    assert choose_quant("auto", pure_config, bf16, gpu, 40 << 30, 1024)[0] == "int4"  # Q4_0's blocks, as they are
    assert choose_quant("gguf", pure_config, bf16, gpu, 40 << 30, 1024) == ("gguf", "asked for")
    assert choose_quant("gguf", mix_config, bf16, cpu, None, 1024) == ("gguf", "asked for")  # on ONNX Runtime
    assert choose_quant("int4", mix_config, bf16, gpu, 40 << 30, 1024) == ("int4", "asked for")
    smollm2 = read_config(locate("builtin/smollm2-135m-instruct").path)  # Q4_1 blocks, 576 wide: 18 blocks of 32
    assert smollm2.gguf_tensor_types == ("Q4_1",)
    assert choose_quant("auto", smollm2, bf16, gpu, 40 << 30, 1024)[0] == "int4"
    mode, why = choose_quant("auto", mix_config, bf16, cpu, None, 1024)
    assert mode == "gguf" and "blocks as stored, on ONNX Runtime" in why
    q3 = tmp_path / "tiny-Q3_K_M.gguf"  # Q3_K has no kernel: the file runs as int8, as before
    write_mix(q3, bpe_vocab, "Q3_K_M")
    mode, why = choose_quant("auto", read_config(locate(str(q3)).path), bf16, gpu, 40 << 30, 1024)
    assert mode == "int8" and "Q3_K_M file holds IQ4_NL, Q3_K, Q5_0, Q5_1, Q5_K weights: int8 carries them" in why
    q3_config = read_config(locate(str(q3)).path)  # on the CPU: Q3_K and IQ4_NL have no ONNX Runtime form
    assert choose_quant("auto", q3_config, bf16, cpu, None, 1024)[0] == "none"
    assert choose_quant("gguf", q3_config, bf16, cpu, None, 1024) == (
        "none", "--quant gguf cannot run here (its IQ4_NL, Q3_K blocks have no ONNX Runtime form here): running it as none")
    assert run(["--model", str(mixed), "--check"], lambda config, plan: 1) == 0
    assert "a Q4_K_M GGUF file: on a GPU --quant auto runs it as its own blocks (--quant gguf) (a Q4_K_M file: its " \
        "Q4_K, Q5_0, Q6_K, Q8_0 blocks run as the file stores them" in capsys.readouterr().out


def test_a_big_endian_file_is_refused_in_one_line(tmp_path, bpe_vocab):
    """llama.cpp's big-endian files (for IBM Z) store the version, and every number after it, swapped."""
    path = tmp_path / "little.gguf"
    write_mix(path, bpe_vocab, "Q8_0")
    data = bytearray(path.read_bytes())
    data[4:8] = data[4:8][::-1]
    swapped = tmp_path / "model-be.gguf"
    swapped.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"model-be\.gguf is a big-endian GGUF file \(made for IBM Z machines\); "
                                        r"this app reads the usual little-endian files"):
        locate(str(swapped))


@pytest.mark.parametrize("kind, grid", [("Q4_0", "q4_0"), ("Q4_1", "minmax")])
def test_int4_keeps_q4_0_and_q4_1_blocks_as_they_are(kind, grid):
    """Blocks as llama.cpp's quantizer makes them (the gguf package's port of it), dequantized, then made int4 in
    groups of 32 the way `int4_grid` says for such a file: the same weights but for float32's rounding of a
    scale (Q4_1's (max − min) / 15). (From their min and max, Q4_0 blocks came back 6.4 % off: their values
    need not reach 7·d.)"""
    from pipeline.llm.weights.quant import dequantize, quantize

    x = (np.random.default_rng(3).standard_normal((64, 1024)) * 0.05).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    weights = torch.from_numpy(reference_dequantize(reference_quantize(x, qtype), qtype).astype(np.float32))
    back = dequantize(quantize(weights, "int4", torch.float32, 32, grid), "int4")
    assert (back - weights).abs().max() <= 1e-6 * weights.abs().max()


def test_int4_grid_follows_the_files_types():
    from types import SimpleNamespace

    from pipeline.llm.weights.quant import int4_grid

    assert int4_grid(SimpleNamespace(gguf_tensor_types=("Q4_0",))) == "q4_0"
    assert int4_grid(SimpleNamespace(gguf_tensor_types=("Q4_1",))) == "minmax"
    assert int4_grid(SimpleNamespace(gguf_tensor_types=())) == "minmax"


def test_the_models_tab_says_what_a_q4_k_m_file_takes_on_a_gpu_and_on_the_cpu(tmp_path):
    """On a GPU the Models tab sizes a Q4_K_M file as `auto` would run it: its own blocks as stored, about the
    file's size, in bf16 (the file llama.cpp's quantizer made, `fixtures/`); int8 in float32, which the kernels
    do not compute in. On the CPU: its ONNX Runtime engine, 1.9× the file as measured, and a float32 cache."""
    import shutil
    from pathlib import Path

    from pipeline.llm.model.kv_cache import KVCache
    from studio.memory_fit import weight_bytes
    from studio.config import StudioConfig
    from studio.model_finder import ModelFinder

    fixture = Path(__file__).parent / "fixtures" / "qwen2-tiny-Q4_K_M.gguf"
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(fixture, models / fixture.name)

    def entry(budget: int | None, dtype: str = "bfloat16", device: str = "cuda"):
        finder = ModelFinder(StudioConfig(models_dir=models, context=256), dtype, device, budget, tmp_path)
        return next(e for e in finder.models() if e.id == str(models / fixture.name))

    roomy = entry(40 << 30)
    config = read_config(roomy.path)
    as_stored = weight_bytes(config, "gguf", torch.bfloat16) + KVCache.row_bytes(config, 257, torch.bfloat16)
    assert roomy.precision == "Q4_K_M blocks as stored, bfloat16" and roomy.quant == "Q4_K_M"
    assert roomy.memory_bytes == as_stored and entry(as_stored).precision == roomy.precision
    assert as_stored < 1.1 * fixture.stat().st_size + KVCache.row_bytes(config, 257, torch.bfloat16)
    assert entry(40 << 30, "float32").precision == "int8 weights, float32"
    on_cpu = entry(None, "float32", "cpu")
    assert on_cpu.precision == "Q4_K_M blocks as stored, ONNX Runtime"
    assert on_cpu.memory_bytes == int(1.9 * fixture.stat().st_size) + KVCache.row_bytes(config, 257, torch.float32)
