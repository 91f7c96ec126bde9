"""The low-bit kernels compiled at load (`plugins/precompile.py`) are exactly those a step can launch.

No GPU here: the three Triton kernels of `plugins.lowbit` are replaced by recorders that note, for each
launch or `compile_only` warm-up, what Triton compiles a kernel for: its name, the constexprs and launch
options, each tensor's dtype and 16-byte alignment, and each integer's class (1, a multiple of 16, other).
Two calls with the same note share one compiled kernel; a note nothing compiled is a compile at a step."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from plugins import lowbit, precompile, lowbit_tuning  # noqa: E402
from plugins.lowbit import Config, LowBitWeight, Workspace, rows_as_one_row  # noqa: E402
from plugins.precompile import VERIFY_ROWS, issue, step_calls  # noqa: E402
from pipeline.llm.weights.quant import quantize  # noqa: E402

CPU = torch.device("cpu")


def _note(name: str, args: tuple, kwargs: dict, unspecialized: frozenset = frozenset()) -> tuple:
    def spec(i, v):
        if i in unspecialized:  # `do_not_specialize`: one kernel for every value
            return "value"
        if isinstance(v, torch.Tensor):
            return str(v.dtype), v.data_ptr() % 16 == 0
        if isinstance(v, bool) or not isinstance(v, int):
            return type(v).__name__
        return 1 if v == 1 else "D" if v % 16 == 0 else "i"  # Triton's integer specialisation
    return name, tuple(spec(i, a) for i, a in enumerate(args)), tuple(sorted(kwargs.items()))


class Recorder:
    """Stands for the Triton kernel `original` (its `do_not_specialize` arguments are not noted)."""

    def __init__(self, name: str, notes: set, original=None):
        self.name, self.notes = name, notes
        names = list(getattr(original, "arg_names", ()))
        self.unspecialized = frozenset(a if isinstance(a, int) else names.index(a)
                                       for a in getattr(original, "do_not_specialize", ()))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.notes.add(_note(self.name, args, kwargs, self.unspecialized))

    def warmup(self, *args, grid, **kwargs):
        self.notes.add(_note(self.name, args, kwargs, self.unspecialized))


@pytest.fixture
def notes(monkeypatch) -> set:
    seen: set = set()
    for name in ("_lowbit_kernel", "_gemv_kernel", "_packed_gemv_kernel"):
        monkeypatch.setattr(lowbit, name, Recorder(name, seen, getattr(lowbit, name)))
    return seen


# (bits, in, out, group, bias, gated, one-row config, batch config): Qwen's q/k/v (bias), a gated MLP, a
# width padded to whole chunks (576: SmolLM2's), int8 (the LM head); one-row configs of 64, 128 and 256
# weight rows (9, 4 and 2 rows per GEMV launch: a verify step's 9 rows take several launches).
SHAPES = [
    (4, 256, 384, 128, True, False, Config(64, 1, 2, 4, 3, "packed"), Config(64, 2, 4)),
    (4, 256, 512, 128, False, True, Config(256, 1, 1, 4, 2, "gemv"), Config(64, 1, 1)),
    (4, 576, 256, 64, False, False, Config(128, 1, 16, 4, 3, "packed"), Config(64, 1, 8)),
    (8, 256, 1000, 0, False, False, Config(256, 1, 2, 4, 2, "gemv"), Config(64, 2, 2)),
]


def real_layer(bits, n_in, n_out, group, bias, gated, one, batch, dtype=torch.bfloat16) -> LowBitWeight:
    parts = quantize(torch.randn(n_out, n_in) * 0.05, f"int{bits}", dtype, group or 128)
    b = torch.randn(n_out).to(dtype) if bias else None
    layer = LowBitWeight.from_parts(parts, bits, dtype, b, Workspace(CPU), gated)
    layer.config, layer.batch_config = one, batch
    return layer


def launched(layer: LowBitWeight, verify: bool) -> set:
    """What steps launch on `layer`: every row count a step gives it (1, the batch kernel's 2–16, prefill past
    it, whatever the unified step's token count), and a verify step's rows (the engine's draft sizes plus
    its last token) as one-row launches."""
    from pipeline.llm.engine.speculation import DRAFT_SIZES

    seen = lowbit._gemv_kernel.notes
    seen.clear()
    for rows in range(1, 81):
        layer(torch.randn(rows, layer.in_features - layer.pad).to(layer.dtype))
    if verify:
        with rows_as_one_row():
            for rows in (k + 1 for k in DRAFT_SIZES):
                layer(torch.randn(rows, layer.in_features - layer.pad).to(layer.dtype))
    out = set(seen)
    seen.clear()
    return out


def compiled(cases) -> set:
    seen = lowbit._gemv_kernel.notes
    seen.clear()
    assert issue(cases) == []
    out = set(seen)
    seen.clear()
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"int{s[0]}-{s[1]}x{s[2]}")
@pytest.mark.parametrize("verify", [True, False], ids=["speculating", "plain"])
def test_the_step_variants_are_exactly_the_kernels_steps_launch(notes, shape, verify):
    layer = real_layer(*shape)
    expected = launched(layer, verify)
    got = compiled([(layer, *call) for call in step_calls(layer, verify)])
    assert got == expected, (f"compiled but never launched: {got - expected}; "
                             f"launched but not compiled: {expected - got}")
    kernels = {n[0] for n in got}
    assert kernels == {"_lowbit_kernel", "_packed_gemv_kernel" if layer.config.kernel == "packed" and layer.bits == 4
                       else "_gemv_kernel"}
    # a verify step's rows are their own variants (ROWS), and the batch and prefill row classes two each
    assert len({n for n in got if n[0] == "_lowbit_kernel"}) == 4
    assert len(got) > 5 if verify else len(got) == 5


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"int{s[0]}-{s[1]}x{s[2]}")
def test_a_stand_in_compiles_what_the_real_layer_launches(notes, shape):
    """Compiling ahead of the weights (`LowBitWeight.stand_in`) gives the kernels the loaded layer uses."""
    bits, n_in, n_out, group, bias, gated, one, batch = shape
    layer = real_layer(*shape)
    stand_in = LowBitWeight.stand_in(bits, torch.bfloat16, n_in, n_out, group, bias, CPU, Workspace(CPU), gated)
    stand_in.config, stand_in.batch_config = one, batch
    assert stand_in.shape_key() == layer.shape_key() and stand_in.in_features == layer.in_features
    assert stand_in.data.numel() < 1024
    for rows in (1, 8):
        real_candidates = compiled(lowbit_tuning.candidate_cases([(layer, rows)]))
        assert compiled(lowbit_tuning.candidate_cases([(stand_in, rows)])) == real_candidates
    assert compiled([(stand_in, *c) for c in step_calls(stand_in, True)]) == launched(layer, True)


def test_compiling_ahead_covers_the_steps_where_tuned_and_the_candidates_where_not(notes):
    """`compile_ahead` in its background thread: a shape with stored configs gets its step variants; a
    shape without them its tuning candidates and the prefill tiles, nothing tuning may not choose."""
    layers = [real_layer(*s) for s in SHAPES[:2]]
    stand_ins = [LowBitWeight.stand_in(b, torch.bfloat16, i, o, g, bias, CPU, Workspace(CPU), gated)
                 for b, i, o, g, bias, gated, _, _ in SHAPES[:2]]
    tuned = lowbit_tuning.TunedConfigs()
    tuned.configs = {f"{layers[0].shape_key()} b1": layers[0].config, f"{layers[0].shape_key()} b8": layers[0].batch_config}
    expected = launched(layers[0], True)
    expected |= compiled(lowbit_tuning.candidate_cases([(layers[1], 1), (layers[1], 8)]))
    expected |= compiled([(layers[1], *c) for c in precompile.prefill_calls(layers[1])])
    said: list[str] = []
    lowbit_tuning.compile_ahead(stand_ins, tuned, True, CPU)
    # the candidates first, on their own: tuning waits for them alone while the rest compile
    assert [job.what for job in precompile._running] == [lowbit_tuning.CANDIDATES_WHAT, "kernels"]
    precompile.settle(said.append, lowbit_tuning.CANDIDATES_WHAT)
    assert [job.what for job in precompile._running] == ["kernels"]
    precompile.settle(said.append)
    assert set(notes) == expected
    assert not precompile._running and "while the weights loaded" in said[-1]


def test_the_verify_rows_are_the_engines_draft_sizes_plus_one():
    from pipeline.llm.engine.speculation import DRAFT_SIZES

    assert VERIFY_ROWS == tuple(k + 1 for k in DRAFT_SIZES)


def test_stand_ins_are_one_per_distinct_layer_shape_of_the_decoder(monkeypatch, qwen2_demo):
    """`kernel_stand_ins` of a meta-device decoder: the shapes `use_kernels` makes of the loaded one."""
    from pipeline.llm.model.decoder import Decoder
    from pipeline.llm.weights.checkpoint import read_config
    from pipeline.llm.weights.quant import QuantLinear, empty_quantized, kernel_stand_ins, quantize_decoder, use_kernels

    monkeypatch.setattr(lowbit, "available", lambda *args: None)  # as on a GPU
    monkeypatch.setattr(QuantLinear, "on_cpu_kernels", property(lambda self: False))  # our kernels, not torch's CPU ones
    config = read_config(qwen2_demo)
    model = quantize_decoder(Decoder(config).to(torch.bfloat16), "int4", "cpu")
    use_kernels(model)
    real = sorted(m.kernel.shape_key() for m in model.modules() if isinstance(m, QuantLinear))
    with torch.device("meta"):
        shapes = empty_quantized(Decoder(config).to(torch.bfloat16), "int4")
    stand_ins = kernel_stand_ins(shapes, CPU)
    assert sorted(s.shape_key() for s in stand_ins) == sorted(set(real))
    assert any(s.gated for s in stand_ins) and all(s.data.numel() < 1 << 16 for s in stand_ins)


def test_the_attention_calls_compile_the_split_kernels_a_steps_attention_launches(monkeypatch):
    """`attention_calls`' stand-ins (a few bytes) against a step's decode attention: q a view of the fused
    q/k/v output, a cache of many rows and positions, batches of 1 and 4 rows, short and long contexts."""
    from plugins import decode_attention as attention
    from plugins.precompile import attention_calls

    seen: set = set()
    monkeypatch.setattr(attention, "_use_triton", lambda x: True)
    for name in ("_split_kernel", "_merge_kernel"):
        monkeypatch.setattr(attention, name, Recorder(name, seen, getattr(attention, name)))
    heads, kv_heads, dim, dtype = 28, 4, 128, torch.bfloat16
    k_cache, v_cache = (torch.empty(8, kv_heads, 4096 + 9, dim, dtype=dtype) for _ in range(2))
    for verify in (True, False):
        expected = set()
        for tokens in (1, *((2, 3, 5, 9) if verify else ())):
            for batch in (1, 4):
                qkv = torch.empty(batch * tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
                q = qkv[:, :heads * dim].view(batch * tokens, heads, dim)
                for kv_len in (256, 4096):
                    lengths = torch.arange(batch * tokens) % kv_len + 1
                    attention.decode_attention(q, k_cache, v_cache, lengths, kv_len, tokens=tokens)
        for size, start, tile in ((16, 0, None), (256, 3744, None), (1024, 3000, attention.LONG_TILE_ROWS)):
            # prompt chunks of row 5 (a long one alone: the long tile)
            q = torch.empty(size, (heads + 2 * kv_heads) * dim, dtype=dtype)[:, :heads * dim].view(size, heads, dim)
            attention.decode_attention(q, k_cache, v_cache, torch.arange(start + 1, start + size + 1), 4096,
                                       rows=torch.full((size,), 5), tile_rows=tile or attention.TILE_ROWS)
        expected = {n for n in seen if n[0] == "_split_kernel"}
        seen.clear()
        assert issue(attention_calls(heads, kv_heads, dim, dtype, CPU, verify)) == []
        got = {n for n in seen if n[0] == "_split_kernel"}
        seen.clear()
        assert got == expected and len(got) == (7 if verify else 3)


def test_the_compile_pool_holds_what_it_is_given_until_started():
    """Kernels are all asked for before any compiles (the compiles starve the asking thread of the GIL); a
    held compile's result or failure reaches its future once started."""
    from plugins.precompile import _Pool

    ran: list[int] = []
    with _Pool() as pool:
        futures = [pool.submit(ran.append, i) for i in range(3)] + [pool.submit(lambda: 1 / 0)]
        assert ran == [] and not any(f.done() for f in futures)
        pool.start()
        late = pool.submit(ran.append, 3)
    assert sorted(ran) == [0, 1, 2, 3] and late.done() and pool.futures == futures + [late]
    assert isinstance(futures[-1].exception(), ZeroDivisionError)


def test_sampling_compile_only_asks_for_the_kernels_a_draw_launches(monkeypatch):
    """`sample_top_k(..., compile_only=True)` (for the engine to compile its sampling kernels ahead)."""
    from plugins import topk_sampling

    seen: set = set()
    for name in ("_block_top_kernel", "_pick_kernel"):
        monkeypatch.setattr(topk_sampling, name, Recorder(name, seen, getattr(topk_sampling, name)))
    for rows in (1, 3, 16):
        logits = torch.empty(rows, 152064)[:, :151665]
        args = (logits, torch.zeros(rows, 151665, dtype=torch.bool), torch.empty(5, rows))
        topk_sampling.sample_top_k(*args)
        launched_notes = set(seen)
        seen.clear()
        topk_sampling.sample_top_k(*args, compile_only=True)
        assert seen == launched_notes and {n[0] for n in seen} == {"_block_top_kernel", "_pick_kernel"}
        seen.clear()


def test_the_sampling_calls_compile_the_one_variant_every_draw_launches(monkeypatch):
    """`sampling_calls` (compiled at load): every draw, of 1, 3, 16 or 40 rows, from a padded vocabulary's
    logits or contiguous ones, in the model's dtype or in float32, launches a kernel they compiled (row
    sizes are not specialised on and row strides are always a multiple of 16: before, each new row count compiled
    the block kernel again)."""
    from plugins import topk_sampling
    from plugins.precompile import sampling_calls

    seen: set = set()
    for name in ("_block_top_kernel", "_pick_kernel"):
        monkeypatch.setattr(topk_sampling, name, Recorder(name, seen, getattr(topk_sampling, name)))
    assert issue(sampling_calls((151665,), torch.bfloat16, CPU)) == []
    compiled = set(seen)
    seen.clear()
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 3, 16, 40):
            for logits in (torch.empty(rows, 152064, dtype=dtype)[:, :151665], torch.empty(rows, 151665, dtype=dtype)):
                topk_sampling.sample_top_k(logits, torch.zeros(rows, 151665, dtype=torch.bool), torch.empty(5, rows))
    assert seen == compiled and len(compiled) == 3, (seen - compiled, compiled)  # the pick kernel reads no logits


def test_the_sampling_calls_cover_each_vocabulary_the_engine_samples_over(monkeypatch):
    """A prompt's last logits are cut to the tokenizer's vocabulary, a width of its own for the pick kernel:
    compiled at load when named (a first reply compiled it, 0.3–0.5 s, H200 2026-11-30), not otherwise."""
    from plugins import topk_sampling
    from plugins.precompile import sampling_calls

    seen: set = set()
    for name in ("_block_top_kernel", "_pick_kernel"):
        monkeypatch.setattr(topk_sampling, name, Recorder(name, seen, getattr(topk_sampling, name)))

    def draws_compiled(vocabs: tuple[int, ...]) -> bool:
        seen.clear()
        assert issue(sampling_calls(vocabs, torch.bfloat16, CPU)) == []
        compiled = set(seen)
        seen.clear()
        topk_sampling.sample_top_k(torch.empty(4, 152064, dtype=torch.bfloat16)[:, :1000],
                                   torch.zeros(4, 1000, dtype=torch.bool), torch.empty(5, 4), compile_only=True)
        return seen <= compiled

    assert draws_compiled((152064, 1000))
    assert not draws_compiled((152064,))
