"""A GGUF file's decoder on the CPU as one ONNX Runtime graph (`engine_builder/gguf_onnx.py`,
`pipeline/llm/model/onnx_decoder.py`, `studio/onnx_llm.py`), against gguf-py (llama.cpp's own reader) and our float
decoder of the same file:

- every block type's MatMulNBits operands dequantize to gguf-py's values bit for bit (random blocks in which every
  bit pattern of quants and sub-scales occurs), and its product in ONNX Runtime, as the graph builds it (offsets
  included), equals the dequantized matrix times the input: within float32 rounding where the graph computes in
  float, within the int8 rounding of the input where it runs MLAS's int8 path;
- the real SmolLM2 Q4_1 file, as `--quant auto` loads it on the CPU: greedy tokens of its float weights, a verify
  step's rows as the same tokens read as a prompt, two chats at different positions in one step each as alone, a
  second turn read after the first as the whole read at once;
- a Q4_K_M file made by llama.cpp's own quantizer (Q4_K and Q6_K, a q/k/v of two types, Qwen2's biases) against
  its float weights; and the engine cache: a second load maps the built engine instead of building it;
- a Qwen3 file (its q/k norms run in the graph) and a split file (its engine is the single file's, rebuilt when
  a later part changes), written as llama.cpp writes them.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference

from test_gguf import bpe_vocab, cache, random_blocks, write_model  # noqa: F401  (the test cache for `locate`)

from engine_builder.gguf_onnx import _Graph, _Writer
from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import Prefill, Rows
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.weights.gguf_nbits import KINDS, from_gguf

ROOT = Path(__file__).resolve().parents[1]
rng = np.random.default_rng(0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_block_type_becomes_matmulnbits_operands_exactly(kind):
    raw = random_blocks(kind, 24, 512, rng)
    want = torch.from_numpy(np.array(reference(raw, GGMLQuantizationType[kind]), np.float32)).reshape(24, 512)
    assert torch.equal(from_gguf(torch.from_numpy(raw), kind, 512).dequantize(), want)


def one_product(folder: Path, raw: np.ndarray, kind: str, width: int, accuracy: int):
    """An ONNX Runtime session of one projection as the graph builder makes it: x [2, 3, width] → y."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    writer = _Writer(folder)
    graph = _Graph(writer)
    out = graph.linear("x", width, torch.from_numpy(raw), kind, "w", accuracy)
    writer.file.close()
    model = helper.make_model(helper.make_graph(
        graph.nodes, "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, width])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], writer.initializers),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, folder / "one.onnx")
    return ort.InferenceSession(str(folder / "one.onnx"), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_block_types_cpu_kernel_computes_its_dequantized_product(kind, tmp_path):
    rows, width = 48, 512
    raw = random_blocks(kind, rows, width, rng)
    weight = torch.from_numpy(np.array(reference(raw, GGMLQuantizationType[kind]), np.float32)).reshape(rows, width)
    x = torch.randn(2, 3, width)
    x[..., 7] = 30.0  # an outlier column, as real activations have
    want = (x.double() @ weight.double().T).float()
    four_bits = from_gguf(torch.from_numpy(raw), kind, width).bits == 4  # 8-bit quants always take int8 inputs
    for accuracy, bound in ((1, 1e-6), (4, 2e-2)) if four_bits else ((4, 2e-2),):
        # float32's rounding; int8 inputs per block of 32 (≤ 1/254 each)
        (folder := tmp_path / str(accuracy)).mkdir()
        got = torch.from_numpy(one_product(folder, raw, kind, width, accuracy).run(None, {"x": x.numpy()})[0])
        assert rel(got, want) < bound, (kind, accuracy, rel(got, want))


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2 Q4_1 on the ONNX engine as the app builds it (int8 inputs where `ACCURACY` says), the same
    graph with float32 inputs wherever ONNX Runtime takes them (its Q4_1 layers; not the Q8_0 head's 8-bit quants),
    each built into a temporary folder, and its float decoder."""
    from engine_builder import gguf_onnx
    from pipeline.llm.model.loading import load_decoder
    from pipeline.models import locate
    from studio.onnx_llm import onnx_gguf_decoder

    folder = locate("builtin/smollm2-135m-instruct").path
    model, how = onnx_gguf_decoder(folder, "smollm2", None)
    assert "Q4_1 blocks as stored (ONNX Runtime" in how
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_onnx, "ACCURACY", {name: 1 for name in gguf_onnx.ACCURACY})
        in_float = onnx_gguf_decoder(folder, "smollm2", None)[0]
    return model, in_float, load_decoder(folder)


PROMPT = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 2000, 77, 28, 1550]])


def greedy(model, steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill PROMPT, then `steps` decode steps of row 0: the tokens and the last step's logits."""
    cache = KVCache(model.config, 2, 64, torch.float32, "cpu")
    rope = RotaryTables(model.config, 64, "cpu")
    logits = model(cache, rope, (Prefill(0, 0),), tokens=PROMPT)[0, -1]
    tokens, position = [int(logits.argmax())], PROMPT.shape[1]
    for _ in range(steps):
        logits = model(cache, rope, (Rows(torch.tensor([position]), torch.tensor([0]), 64),),
                       tokens=torch.tensor([[tokens[-1]]]))[0, -1]
        tokens.append(int(logits.argmax()))
        position += 1
    return tokens, logits


def test_smollm2_on_onnx_runtime_decodes_as_its_float_weights(smollm2):
    onnx_model, in_float, float_model = smollm2
    with torch.inference_mode():
        ours, last = greedy(onnx_model, 8)
        exact, exact_last = greedy(in_float, 8)
        theirs, float_last = greedy(float_model, 8)
    assert ours == exact == theirs
    assert rel(exact_last, float_last) < 3e-2, rel(exact_last, float_last)  # the layers in float, the head's int8 input
    assert rel(last, float_last) < 0.1, rel(last, float_last)  # int8 inputs: their rounding, over 30 layers


def test_verify_rows_batches_and_second_turns_match_single_steps(smollm2):
    """On the graph with float32 layers (a wrong position, cache row or mask would move the logits by tens of
    percent): with int8 inputs, a change in the last bit of an input (attention summed in another order, by a batch
    of other rows or of one) can move an int8 rounding, which 30 layers grow to a few percent of the logits; so this
    engine does not speculate. The bound is the head's int8 input (Q8_0's 8-bit quants take no float inputs)."""
    _, model, _ = smollm2
    c = model.config
    with torch.inference_mode():
        caches = [KVCache(c, 2, 64, torch.float32, "cpu") for _ in range(3)]
        rope = RotaryTables(c, 64, "cpu")
        n = PROMPT.shape[1]
        # a prompt read whole, and read as two turns (the second after the first's keys are in the cache)
        whole = model(caches[0], rope, (Prefill(0, 0),), tokens=PROMPT)[0]
        model(caches[1], rope, (Prefill(0, 0),), tokens=PROMPT[:, :9])
        second = model(caches[1], rope, (Prefill(0, 9),), tokens=PROMPT[:, 9:])[0]
        assert rel(second, whole[9:]) < 5e-3
        # a verify step (the last token and two drafts) reads as the same tokens read as a prompt
        drafts = [5, 6, 7]
        verify = model(caches[1], rope, (Rows(torch.tensor([n]), torch.tensor([0]), 64, 3),),
                       tokens=torch.tensor([drafts]))[0]
        read = model(KVCache(c, 1, 64, torch.float32, "cpu"), rope, (Prefill(0, 0),),
                     tokens=torch.cat([PROMPT, torch.tensor([drafts])], 1))[0, -3:]
        assert rel(verify, read) < 5e-3
        # two chats in one step (row 1 at an earlier position) give each the numbers it gets alone
        single = model(caches[0], rope, (Rows(torch.tensor([n]), torch.tensor([0]), 64),), tokens=torch.tensor([[5]]))[0, 0]
        model(caches[2], rope, (Prefill(1, 0),), tokens=PROMPT[:, :5])
        model(caches[2], rope, (Prefill(0, 0),), tokens=PROMPT)
        both = model(caches[2], rope, (Rows(torch.tensor([n, 5]), torch.tensor([0, 0]), 64),),
                     tokens=torch.tensor([[5, 9]]))[0]
        alone = KVCache(c, 1, 64, torch.float32, "cpu")
        model(alone, rope, (Prefill(0, 0),), tokens=PROMPT[:, :5])
        row1 = model(alone, rope, (Rows(torch.tensor([5]), torch.tensor([0]), 64),), tokens=torch.tensor([[9]]))[0, 0]
        assert rel(both[0], single) < 5e-3 and rel(both[1], row1) < 5e-3, (rel(both[0], single), rel(both[1], row1))

def test_a_q4_k_m_file_made_by_llama_cpps_quantizer_runs_on_onnx_runtime(monkeypatch):
    """Its graph with float32 inputs wherever ONNX Runtime takes them (the Q4_K layers; its Q6_K ones take int8) gives
    its float weights' logits within that rounding (the mixed types, the offsets, the biases are placed right); with
    the int8 inputs the app runs, within theirs."""
    from engine_builder import gguf_onnx
    from pipeline.llm.model.loading import load_decoder
    from pipeline.models import locate
    from studio.onnx_llm import onnx_gguf_decoder

    folder = locate(str(ROOT / "tests" / "fixtures" / "qwen2-tiny-Q4_K_M.gguf")).path
    ids = torch.tensor([[i % 600 for i in range(3, 40, 3)]])

    def logits(model) -> torch.Tensor:
        cache = KVCache(model.config, 1, 32, torch.float32, "cpu")
        with torch.inference_mode():
            return model(cache, RotaryTables(model.config, 32, "cpu"), (Prefill(0, 0),), tokens=ids)[0]

    want = logits(load_decoder(folder))
    model, how = onnx_gguf_decoder(folder, "tiny", None)
    assert "Q4_K_M blocks as stored" in how, how
    assert rel(logits(model), want) < 0.1, rel(logits(model), want)
    monkeypatch.setattr(gguf_onnx, "ACCURACY", {name: 1 for name in gguf_onnx.ACCURACY})
    assert rel(logits(onnx_gguf_decoder(folder, "tiny", None)[0]), want) < 2e-2

def test_the_engine_is_built_once_then_mapped_from_the_cache(tmp_path):
    from engine_builder.build import EngineOptions
    from engine_builder.cache import EngineCache
    from pipeline.models import locate
    from studio.onnx_llm import onnx_gguf_decoder

    class Report:
        lines: list[str] = []

        def tell(self, line: str) -> None:
            self.lines.append(line)

        say = tell

    folder = locate(str(ROOT / "tests" / "fixtures" / "qwen2-tiny-Q4_K_M.gguf")).path
    options = EngineOptions(EngineCache(tmp_path), Report())
    onnx_gguf_decoder(folder, "tiny", options)
    assert any("engine built in" in line for line in Report.lines)
    Report.lines.clear()
    onnx_gguf_decoder(folder, "tiny", options)
    assert any("loaded from cache" in line for line in Report.lines) and \
        not any("building" in line for line in Report.lines), Report.lines


def gguf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = KVCache(model.config, 1, 32, torch.float32, "cpu")
    with torch.inference_mode():
        return model(cache, RotaryTables(model.config, 32, "cpu"), (Prefill(0, 0),), tokens=ids)[0]


def test_a_qwen3_file_runs_its_q_and_k_norms_in_the_graph(tmp_path, bpe_vocab, monkeypatch):  # noqa: F811
    """With float32 inputs everywhere (Q4_0 takes them), its graph gives its float weights' logits within float32
    rounding."""
    from engine_builder import gguf_onnx
    from pipeline.llm.model.loading import load_decoder
    from pipeline.models import locate
    from studio.onnx_llm import onnx_gguf_decoder

    folder = locate(str(write_model(tmp_path / "qwen3.gguf", bpe_vocab, arch="qwen3", kind="Q4_0"))).path
    ids = torch.tensor([[i % 300 for i in range(3, 60, 3)]])
    want = gguf_logits(load_decoder(folder), ids)
    assert load_decoder(folder).config.qk_norm
    monkeypatch.setattr(gguf_onnx, "ACCURACY", {name: 1 for name in gguf_onnx.ACCURACY})
    error = rel(gguf_logits(onnx_gguf_decoder(folder, "qwen3", None)[0], ids), want)
    assert error < 1e-4, error  # 1.7e-6 seen


def test_a_split_files_engine_is_the_single_files_and_is_rebuilt_when_a_later_part_changes(tmp_path, bpe_vocab):  # noqa: F811
    from engine_builder.build import EngineOptions
    from engine_builder.cache import EngineCache
    from pipeline.models import locate
    from studio.onnx_llm import onnx_gguf_decoder
    from studio.startup_report import StartupReport

    for name, seed in (("one", 0), ("split", 0), ("other", 1)):
        (tmp_path / name).mkdir()
        write_model(tmp_path / name / "tiny.gguf", bpe_vocab, kind="Q4_K", seed=seed,
                    split_max_tensors=0 if name == "one" else 12)
    parts = sorted((tmp_path / "split").glob("*.gguf"))
    ids = torch.tensor([[i % 300 for i in range(3, 60, 3)]])
    options = EngineOptions(EngineCache(tmp_path / "engines"), StartupReport(out=None))
    whole = gguf_logits(onnx_gguf_decoder(locate(str(tmp_path / "one" / "tiny.gguf")).path, "one", None)[0], ids)
    first = gguf_logits(onnx_gguf_decoder(locate(str(parts[0])).path, "split", options)[0], ids)
    assert torch.equal(first, whole)
    parts[1].write_bytes(sorted((tmp_path / "other").glob("*.gguf"))[1].read_bytes())  # a newer second part
    options.report.lines.clear()
    changed = gguf_logits(onnx_gguf_decoder(locate(str(parts[0])).path, "split", options)[0], ids)
    assert any("engine built in" in line for line in options.report.lines), options.report.lines
    assert rel(changed, first) > 0.1
