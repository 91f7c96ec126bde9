"""The pipelines on a CUDA GPU, as `launch.py` runs them there (bf16, CUDA graphs).

Skipped without a GPU (CI has none); run on the lent H100 with `python3 -m pytest tests/test_gpu.py`.
Each graphed path is checked against the same computation run eagerly.
"""

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the CPU paths are covered by the other tests)", allow_module_level=True)

from pipeline.pipelines.chat import ChatPipeline  # noqa: E402
from studio.backends import load_language_model, sam_engine, vision_encoder  # noqa: E402
from pipeline.pipelines.image_chat import ImageChatPipeline  # noqa: E402
from pipeline.images import load_image  # noqa: E402
from pipeline.llm.demo import demo_model_dir  # noqa: E402
from pipeline.llm.engine.torch_engine import TorchLLMEngine  # noqa: E402
from pipeline.llm.engine.params import SamplingParams  # noqa: E402
from pipeline.llm.text.prompt import Prompt  # noqa: E402
from pipeline.minigpt4.engine import TorchVisionEncoder  # noqa: E402
from pipeline.minigpt4.weights import demo_vision_dir, load_vision_folder  # noqa: E402
from pipeline.cuda_graphs import CapturedCall  # noqa: E402
from pipeline.sam.model import load_sam  # noqa: E402
from pipeline.sam.weights import resolve_sam  # noqa: E402
from pipeline.sam.engine import GraphedSamEngine, TorchSamEngine  # noqa: E402
from pipeline.sam.transforms import preprocess, resize_longest  # noqa: E402
from pipeline.pipelines.segment import SegmentPipeline, SegmentStats  # noqa: E402

from test_qwen_vl_chat import folder as qwen_vl_folder  # noqa: E402,F401 - the tiny Qwen2.5-VL fixture

GREEDY = SamplingParams(max_new_tokens=300, temperature=0, repetition_penalty=1.0)


@pytest.mark.parametrize("name", ["demo/qwen-v1-tiny", "demo/qwen2-tiny"])
def test_chat_on_gpu_graphs_match_eager(studio_cache, name):
    llm = load_language_model(demo_model_dir(name, studio_cache), name, device="cuda", dtype=torch.bfloat16,
                              max_context=1024)
    pipe = ChatPipeline(llm)
    engine = llm.engine
    assert engine.use_cuda_graphs
    prompt = pipe.llm.format.render([{"role": "user", "content": "Hello 你好"}])
    graphed = list(engine.submit(prompt, GREEDY, set()))  # crosses a 256-token bucket
    eager_engine = TorchLLMEngine(engine.model, 1024, llm.tokenizer.vocab_size, use_cuda_graphs=False)
    eager = list(eager_engine.submit(prompt, GREEDY, set()))
    assert graphed == eager and len(graphed) == 300
    eager_engine.close()
    # Four at once through the graphed batch buckets (one of them reusing the finished reply's cached prompt)
    # give the single reply, all of it: float weights on a GPU are batch-invariant by default (with cuBLAS a
    # batch-4 GEMM rounds unlike a batch-1 GEMV, and which steps run 1 or 4 rows depends on when each arrives).
    assert "batch-invariant" in llm.description
    streams = [engine.submit(prompt, GREEDY, set()) for _ in range(4)]
    batched = [list(s) for s in streams]
    assert engine.status()["reused_tokens"] > 0
    assert all(b == graphed for b in batched)
    events = list(pipe.stream([{"role": "user", "content": "Hi"}], SamplingParams(max_new_tokens=20, seed=3)))
    assert events[-1].stats.new_tokens > 0


def test_image_chat_on_gpu(studio_cache):
    llm = load_language_model(demo_model_dir("demo/llama-tiny", studio_cache), "demo/llama-tiny", device="cuda",
                              dtype=torch.bfloat16, max_context=2048)
    vision_dir = demo_vision_dir(studio_cache, llm_width=64)
    vision = load_vision_folder(vision_dir / "prerained_minigpt4_7b.pth", vision_dir, "cuda", torch.bfloat16)
    pipe = ImageChatPipeline(vision_encoder(vision), llm)
    photo = load_image("assets/examples/fruit_bowl.jpg")
    pipe.encode_image(photo)
    first = list(pipe.stream(photo, [{"role": "user", "content": "What is it?"}], SamplingParams(max_new_tokens=12),
                             session="s"))
    answer = "".join(e.text for e in first)
    second = list(pipe.stream(photo, [{"role": "user", "content": "What is it?"},
                                      {"role": "assistant", "content": answer},
                                      {"role": "user", "content": "Why?"}], SamplingParams(max_new_tokens=12),
                              session="s"))
    assert second[-1].stats.prompt_tokens > first[-1].stats.prompt_tokens and pipe.encoder_runs == 1
    assert second[-1].stats.cached_tokens > 32  # the image's slot was not recomputed


def test_segment_on_gpu_graphs_match_eager(studio_cache):
    sam = load_sam(resolve_sam("demo/sam-tiny", studio_cache), device="cuda", dtype=torch.bfloat16)
    seg = SegmentPipeline(sam_engine(sam))
    assert isinstance(seg.engine, GraphedSamEngine) and "CUDA graphs" in seg.description
    eager = TorchSamEngine(seg.engine.model)
    photo = load_image("assets/examples/shapes.jpg")
    stats = SegmentStats()
    handle = seg.set_image(photo, stats)
    pixels = resize_longest(torch.from_numpy(photo).cuda(), 1024)
    embedding = eager.encode(preprocess(pixels, 1024))
    assert torch.equal(seg._embedding(handle, SegmentStats()), embedding)  # the replayed encoder graph
    for points, labels, box in [([[100, 200]], [1], None), ([[100, 200], [500, 300]], [1, 0], None),
                                ([[100, 200]], [1], [50, 50, 400, 400]), ([], [], [50, 50, 400, 400])]:
        for _ in range(2):  # capture, then replay
            result = seg.predict(handle, points, labels, box, stats=stats)
        scale = torch.tensor([1024 / 800, 768 / 600], device="cuda")
        pts = (torch.tensor([points], device="cuda") * scale, torch.tensor([labels], device="cuda")) if points else None
        bx = (torch.tensor([box], device="cuda").view(1, 2, 2) * scale).view(1, 4) if box else None
        low, _ = eager.decode(embedding, pts, bx, None, True)
        assert np.array_equal(result.low_res_logits, low[0].float().cpu().numpy())
        assert result.masks.shape == (3, 600, 800)
    assert stats.encoder_runs == 1
    # Segment everything (batched prompts, run eagerly) gives the eager pipeline's masks. The random demo
    # passes no quality filter (its default result is empty), so every mask is kept: the check has teeth.
    loose = dict(points_per_side=8, min_score=-1.0, min_stability=-1.0, nms_iou=1.0)
    everything = seg.segment_everything(handle, **loose)
    eager_seg = SegmentPipeline(eager)
    reference = eager_seg.segment_everything(eager_seg.set_image(photo), **loose)
    assert len(everything) > 10 and len(everything) == len(reference)
    assert all(m.mask.shape == (600, 800) and m.mask.dtype == bool and m.mask.any() for m in everything)
    assert all(np.array_equal(a.mask, b.mask) and a.score == b.score for a, b in zip(everything, reference))


def test_minigpt4_encoder_graph_matches_eager(studio_cache):
    vision_dir = demo_vision_dir(studio_cache, llm_width=64)
    model = load_vision_folder(vision_dir / "prerained_minigpt4_7b.pth", vision_dir, "cuda", torch.bfloat16)
    encoder = TorchVisionEncoder(model)
    pixels = torch.randn(1, 3, 224, 224)
    for _ in range(2):  # capture, then replay
        graphed = encoder.encode(pixels)
    with torch.inference_mode():
        assert encoder.name == "torch (CUDA graphs)" and torch.equal(graphed, model(pixels.cuda().bfloat16())[0])


def test_fused_kernels_match_the_torch_reference():
    from plugins.fused import add_rms_norm_fused as add_rms_norm
    from plugins.fused import add_rms_norm_reference
    from plugins.fused import rms_norm_fused as rms_norm
    from plugins.fused import rms_norm_reference, rotary_reference, silu_mul_reference
    from plugins.fused import rotary_fused as rotary_
    from plugins.fused import silu_mul_fused as silu_mul

    def close(a, b, tol):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        return rel <= tol and (a == b).float().mean().item() > 0.9

    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (64, 3584, 4096):  # demo, Qwen2.5-7B and Qwen-7B widths
        x = torch.randn(5, n, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
        assert close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), 1e-3)
        d = torch.randn(5, n, device="cuda", dtype=torch.bfloat16, generator=g)
        (total, normed), (total_ref, normed_ref) = add_rms_norm(x, d, w, 1e-6), add_rms_norm_reference(x, d, w, 1e-6)
        assert torch.equal(total, total_ref) and close(normed, normed_ref, 1e-3)
    for n in (128, 11008, 18944):
        gu = torch.randn(3, 2 * n, device="cuda", dtype=torch.bfloat16, generator=g)
        assert close(silu_mul(gu), silu_mul_reference(gu), 1e-3)
    qkv = torch.randn(1, 6, (32 + 2 * 4) * 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q = qkv[..., :32 * 128].view(1, 6, 32, 128)  # a strided view, as in the decoder
    cos, sin = torch.randn(1, 6, 128, device="cuda", generator=g), torch.randn(1, 6, 128, device="cuda", generator=g)
    expected = rotary_reference(q.clone(), cos, sin)
    out = rotary_(q, cos, sin)
    assert out.data_ptr() == q.data_ptr()  # in place
    assert ((out.float() - expected.float()).norm() / expected.float().norm()).item() <= 4e-3
    qkv = torch.randn(4, 1, (28 + 2 * 4) * 128, device="cuda", dtype=torch.bfloat16, generator=g)  # a decode batch
    q = qkv[..., :28 * 128].view(4, 1, 28, 128)
    cos, sin = torch.randn(4, 1, 128, device="cuda", generator=g), torch.randn(4, 1, 128, device="cuda", generator=g)
    expected = rotary_reference(q.clone(), cos, sin)
    assert rotary_(q, cos, sin).data_ptr() == q.data_ptr()
    assert ((q.float() - expected.float()).norm() / expected.float().norm()).item() <= 4e-3


@pytest.mark.parametrize("mode,group", [("int8", 128), ("int4", 128), ("int4", 32)])
def test_lowbit_kernels_match_the_dequantizing_reference(mode, group):
    """The low-bit kernels (tensor cores; for one row, also the CUDA-core GEMVs: fp32 and packed bf16 pairs),
    split (up to 16 ways) and unsplit, at batch
    1, 4, 5 and 64 give the
    reference's numbers on our stored format, int4 in our groups of 128 and a GGUF file's 32: a wrong
    nibble order, zero point or scale layout would be far off; the split-K counters are left at zero."""
    from plugins import lowbit
    from pipeline.llm.weights.quant import QuantLinear

    g = torch.Generator(device="cuda").manual_seed(0)
    for n_in, n_out in ((3584, 4608), (18944, 3584), (896, 1152)):  # Qwen2.5-7B's qkv and down; 0.5B's qkv
        # (not a multiple of the 256-row tile)
        linear = torch.nn.Linear(n_in, n_out, bias=True, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.normal_(0, 0.02, generator=g)
        layer = QuantLinear.from_linear(linear, mode, group=group)
        assert layer.kernel_unavailable() is None
        reference = layer.weight_float().to(torch.bfloat16)
        layer.use_kernel(lowbit.Workspace(torch.device("cuda")))
        assert all(t.numel() == 0 for t in layer.parts().values())  # the reference buffers are freed
        for batch in (1, 4, 5, 64):
            x = torch.randn(batch, n_in, device="cuda", dtype=torch.bfloat16, generator=g)
            expected = torch.nn.functional.linear(x, reference, linear.bias).float()
            configs = [lowbit.Config(32, 2, split) for split in (1, 4)] + [None]
            configs += [lowbit.Config(bn, st, split, kernel=kernel) for kernel in ("gemv", "packed")
                        for bn, st in ((64, 2), (256, 1)) for split in (1, 4, 16)]  # one row: CUDA cores
            for config in configs:
                err = ((layer.kernel(x, config).float() - expected).norm() / expected.norm()).item()
                assert err < 1e-2, (mode, group, n_in, batch, config, err)
        assert not layer.kernel.workspace.counters.any()


def test_quantized_chat_graphs_match_eager():
    """int4 through the low-bit kernel (tuned, split-K) in the graphed engine gives the eager int4
    engine's tokens, at batch 1 and with three chats at once (the demo models are too narrow for the
    kernel's 128-input groups, so a small random decoder of kernel-sized widths)."""
    from pipeline.llm.weights.config import DecoderConfig
    from pipeline.llm.model.decoder import Decoder
    from pipeline.llm.weights.quant import quantize_decoder, use_kernels
    from plugins.lowbit_tuning import TunedConfigs

    config = DecoderConfig(family="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=1024, qkv_bias=True)
    torch.manual_seed(0)
    model = quantize_decoder(Decoder(config).to(torch.bfloat16), "int4", "cuda").cuda().eval()
    use_kernels(model, TunedConfigs())
    assert "triton" in repr(model)
    params = SamplingParams(max_new_tokens=40, temperature=0, repetition_penalty=1.0)
    replies = []
    for graphs in (True, False):
        engine = TorchLLMEngine(model, 1024, config.vocab_size, max_batch=4, use_cuda_graphs=graphs)
        streams = [engine.submit(Prompt(tuple(range(s, s + 20))), params, set()) for s in (1, 2, 3)]
        replies.append([list(s) for s in streams])
        engine.close()
    assert replies[0] == replies[1] and all(len(r) == 40 for r in replies[0])


@pytest.mark.parametrize("mode,gguf_type", [("int4", ""), ("int8", ""), ("int4", "Q4_K")])
def test_a_low_bit_verify_step_gives_the_decode_steps_logits_bit_for_bit(mode, gguf_type):
    """Speculative decoding's verify step (one chat's last token and 1, 2, 4 or 8 drafted ones, a CUDA
    graph each) gives exactly the logits of the decode steps it stands for, whichever one-row kernel a
    layer was tuned to (packed bf16 pairs, the fp32 GEMV, the tensor cores; split or not; rows in several
    launches where they outgrow one's registers, `rows_per_gemv`) and with the untied LM head in int8:
    greedy speculation then keeps plain decoding's tokens. Without `rows_as_one_row` the tensor-core
    kernel ran the verify rows and rounded otherwise; with one pinned buffer for every decode step's rows
    (before 2026-11-27) the graphed decode steps read the next step's tokens once the GPU fell behind.
    A Q4_K GGUF file's int4 keeps its blocks of 32 (`quant.int4_group`) and must hold to it too."""
    from pipeline.llm.engine.model_runner import ChunkRead, ModelRunner, RowsFeed
    from pipeline.llm.model.decoder import Decoder
    from pipeline.llm.model.kv_cache import KVCache
    from pipeline.llm.weights.config import DecoderConfig
    from pipeline.llm.weights.quant import quantize_decoder, use_kernels
    from plugins import lowbit
    from plugins.lowbit_tuning import TunedConfigs

    config = DecoderConfig(family="qwen2", vocab_size=1024, hidden_size=512, intermediate_size=1536, num_layers=2,
                           num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=1024, qkv_bias=True,
                           gguf_type=gguf_type)
    torch.manual_seed(0)
    model = quantize_decoder(Decoder(config).to(torch.bfloat16), mode, "cuda").cuda().eval()
    use_kernels(model, TunedConfigs())
    layers = [m.kernel for m in model.modules() if getattr(m, "kernel", None) is not None]
    tokens = [77, 5, 900, 31, 2, 64, 1000, 8, 300]
    for one_row in [None] + [lowbit.Config(bn, st, split, kernel=kernel) for kernel, bn, st in
                             (("packed", 128, 1), ("gemv", 256, 1), ("mma", 32, 2)) for split in (1, 4)]:
        if one_row is not None:
            for layer in layers:
                layer.config = one_row
        runner = ModelRunner(model, 512, config.vocab_size, max_batch=2)
        cache = KVCache(config, 2, runner.positions, torch.bfloat16, "cuda")
        with torch.inference_mode():
            runner.step(cache, None, [ChunkRead(Prompt(tuple(range(3, 43))), 0, 0, 40, 0, logits=False)], graphed=False)
            stepped = torch.stack([runner.step(cache, RowsFeed(1, [[token]], [40 + t], [0], kv_need=41 + t))[0][0, 0].clone()
                                   for t, token in enumerate(tokens)])
            for size in (2, 3, 5, 9):
                verified = runner.step(cache, RowsFeed(1, [tokens[:size]], [40], [0], kv_need=40 + size))[0][0]
                assert torch.equal(verified, stepped[:size]), (mode, gguf_type, one_row, size,
                                                               (verified - stepped[:size]).abs().max())
        runner.close()


def _int4_model(seed: int = 0):
    """A small int4 Qwen2-shaped decoder on the low-bit kernels (tuned now)."""
    from pipeline.llm.model.decoder import Decoder
    from pipeline.llm.weights.config import DecoderConfig
    from pipeline.llm.weights.quant import quantize_decoder, use_kernels
    from plugins.lowbit_tuning import TunedConfigs

    config = DecoderConfig(family="qwen2", vocab_size=1024, hidden_size=1024, intermediate_size=4096, num_layers=4,
                           num_heads=16, num_kv_heads=4, head_dim=64, max_position_embeddings=2048, qkv_bias=True)
    torch.manual_seed(seed)
    model = quantize_decoder(Decoder(config).to(torch.bfloat16), "int4", "cuda").cuda().eval()
    use_kernels(model, TunedConfigs())
    return model


def test_two_engines_over_one_int4_model_at_once_give_what_each_gives_alone():
    """A plain and a speculating engine over one int4 model, decoding at the same time on their two streams,
    each give the greedy replies they give alone, and the speculating one plain decoding's, round after
    round. Before each runner had its own split-K scratch (2026-11-27), the two shared one model's
    arrival counters: a race left a counter off zero, every later call on that tile added the wrong
    partials, and int4 speculation's replies parted from plain decoding's in some runs and not in others."""
    import threading

    from pipeline.llm.engine.speculation import GPU_LOW_BIT, PromptLookup, Speculation

    model = _int4_model()
    params = SamplingParams(max_new_tokens=96, temperature=0, repetition_penalty=1.0)
    alone_engine = TorchLLMEngine(model, 2048, 1024, max_batch=4)
    plain = TorchLLMEngine(model, 2048, 1024, max_batch=4)
    fast = TorchLLMEngine(model, 2048, 1024, max_batch=4, speculation=Speculation(PromptLookup(), GPU_LOW_BIT))

    def replies(engine, prompts) -> list[list[int]]:  # one chat at a time: its verify rows round as its decode steps
        return [list(engine.submit(p, params, set())) for p in prompts]

    for round_ in range(4):  # new prompts each round: no engine finds them in its cache (that reads them otherwise)
        prompts = [Prompt(tuple(int(t) for t in torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(
            n + round_)))) for n in (40, 300, 700)]
        alone = replies(alone_engine, prompts)
        beside: list = []
        thread = threading.Thread(target=lambda: beside.append(replies(plain, prompts)))
        thread.start()
        together = replies(fast, prompts)
        thread.join()
        assert together == alone, round_
        assert beside == [alone], round_
    assert fast.status()["drafted_tokens"] > 0
    for engine in (alone_engine, plain, fast):
        engine.close()


def _other_work(kind: str):
    """One piece of GPU work of `kind`, as another engine's thread does it while a capture runs; `step(k)`."""
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, n, c: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + c, mask=i < n)

    t = torch.randn(256, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    own = torch.Generator("cuda").manual_seed(2)
    graph = CapturedCall(lambda x: x @ x, t) if kind == "a graph replayed" else None
    return {
        "kernels": lambda k: (t @ t).sum(),
        "allocations and an emptied cache": lambda k: (torch.empty(1 << 20 + k % 8, device="cuda").fill_(1),
                                                       torch.cuda.empty_cache()),
        "a read back": lambda k: (t @ t).sum().item(),
        "pageable copies each way": lambda k: t.copy_(torch.full(t.shape, float(k))).cpu(),
        "an event waited on": lambda k: torch.cuda.current_stream().record_event().synchronize(),
        "a graph replayed": lambda k: graph(t).sum().item(),
        "a Triton kernel compiled": lambda k: add[(1,)](t, 64, c=float(k % 4), BLOCK=64),
        "draws from its own generator": lambda k: torch.rand(1024, device="cuda", generator=own).sum().item(),
    }[kind]


@pytest.mark.parametrize("kind", ["kernels", "allocations and an emptied cache", "a read back",
                                  "pageable copies each way", "an event waited on", "a graph replayed",
                                  "a Triton kernel compiled", "draws from its own generator"])
def test_a_capture_holds_while_another_thread_does_gpu_work(kind):
    """No gate holds other threads' GPU work back while a graph is captured (`plugins.cuda_streams`): each kind
    of work the engines do, looping on another thread's stream, leaves every capture whole and right."""
    import threading

    from plugins.cuda_streams import own_stream, release

    w = torch.randn(512, 512, device="cuda") / 23

    def body(x):
        for _ in range(100):
            x = torch.tanh(x @ w) + 0.01
        return x

    stream, stop, done, errors = own_stream(), threading.Event(), [0], []

    def loop():
        with torch.cuda.stream(stream):
            step = _other_work(kind)
            k = 0
            while not stop.is_set():
                try:
                    step(k)
                    done[0] += 1
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return
                k += 1

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        while not done[0] and not errors:
            stop.wait(0.01)
        for seed in range(6):
            x = torch.randn(64, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
            captured = CapturedCall(body, x)
            assert torch.allclose(captured(x), body(x), atol=1e-4)
        during = done[0]
    finally:
        stop.set()
        thread.join()
        release(stream)
    assert not errors, errors
    assert during > 1


def test_engines_tune_and_capture_while_another_engine_replies():
    """While one engine replies without pause, a model's kernels are tuned (each candidate timed in a captured
    graph) and two engines over it start (their step tables captured, their verify steps timed): every graph
    is captured, nothing fails or warns, and every reply is the one its model gives alone; no gate held the
    replying engine back."""
    import threading
    import warnings

    from pipeline.llm.engine.speculation import GPU_LOW_BIT, PromptLookup, Speculation

    model = _int4_model()
    params = SamplingParams(max_new_tokens=64, temperature=0, repetition_penalty=1.0)
    prompts = [Prompt(tuple(int(t) for t in torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n))))
               for n in (40, 300, 700)]

    def replies(engine) -> list[list[int]]:  # one chat at a time: the same rows in every step as alone
        return [list(engine.submit(p, params, set())) for p in prompts]

    serving = TorchLLMEngine(model, 2048, 1024, max_batch=4)
    alone = replies(serving)
    stop, rounds, errors = threading.Event(), [], []

    def serve():
        try:
            while not stop.is_set():
                rounds.append(replies(serving))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=serve)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread.start()
        try:
            steps = serving.steps
            twin = _int4_model()  # the same weights, its kernels tuned now (their configs may differ: timed)
            started = []
            for _ in range(2):
                engine = TorchLLMEngine(twin, 2048, 1024, max_batch=4,
                                        speculation=Speculation(PromptLookup(), GPU_LOW_BIT, measured=True))
                started.append(replies(engine))
                assert engine.runner.captures == len(engine.runner.table_keys()) and not engine.runner.missed
                engine.close()
            assert serving.steps > steps
        finally:
            stop.set()
            thread.join()
    assert not errors, errors
    assert not [str(w.message) for w in caught if "failed" in str(w.message)]
    assert rounds and all(r == alone for r in rounds)
    plain = TorchLLMEngine(twin, 2048, 1024, max_batch=4)
    assert started == [replies(plain)] * 2
    for engine in (serving, plain):
        engine.close()


def test_rope_and_kv_write_in_one_kernel_matches_the_reference():
    from plugins.fused import rope_cache_write_fused, rope_cache_write_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim = 28, 4, 128  # Qwen2.5-7B
    qkv = torch.randn(4, 1, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (t.view(4, 1, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    cos, sin = (torch.rand(4, 1, dim, device="cuda", generator=g) for _ in range(2))
    positions = torch.tensor([7, 0, 300, 31], device="cuda")
    caches = [torch.randn(4, kv_heads, 512, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    caches += [c.clone() for c in caches]
    expected = rope_cache_write_reference(q.clone(), k.clone(), v.clone(), cos, sin, caches[0], caches[1], positions)
    got = rope_cache_write_fused(q, k, v, cos, sin, caches[2], caches[3], positions)
    assert got.data_ptr() == q.data_ptr()
    for a, b in ((got, expected), (caches[2], caches[0])):  # one rounding instead of three: within bf16
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() <= 4e-3
    assert torch.equal(caches[3], caches[1])


def test_streams_of_their_own_are_never_shared_while_held():
    """torch's pool hands out 32 streams per priority round-robin: the 33rd `torch.cuda.Stream()` is the
    first again. An engine replaying on the stream another engine captured on broke the capture."""
    from plugins import cuda_streams
    from plugins.cuda_streams import capture_stream, own_stream, release

    capture_stream()
    others = len(cuda_streams._claimed)  # the capture stream, and the engines of earlier tests still alive
    held = [own_stream() for _ in range(40)]
    assert len({s.cuda_stream for s in held + [capture_stream()]}) == 41
    handle = held[0].cuda_stream
    release(held.pop(0))
    fresh = [own_stream() for _ in range(64 - others - 39)]  # every stream not held
    assert handle in {s.cuda_stream for s in fresh}  # given back, handed out again
    for s in held + fresh:
        release(s)


def test_a_prompt_chunks_attention_matches_the_reference_at_qwen_7b_heads():
    """The chunk path of `decode_attention` (tiles of one row's queries, split over its keys) against the fp32
    reference, for a chunk at the start of a row and one after 3,744 positions, a split boundary inside it."""
    from plugins.decode_attention import decode_attention, decode_attention_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim = 28, 4, 128
    k_cache, v_cache = (torch.randn(3, kv_heads, 4096 + 9, dim, device="cuda", dtype=torch.bfloat16, generator=g)
                        for _ in range(2))
    for size, start in ((256, 0), (256, 3744), (100, 1000)):
        rows = torch.ones(size, dtype=torch.long, device="cuda")
        q = torch.randn(size, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        lengths = torch.arange(start + 1, start + size + 1, device="cuda")
        kv_len = 1 << (start + size - 1).bit_length()
        expected = decode_attention_reference(q, k_cache, v_cache, lengths, kv_len, rows=rows)
        got = decode_attention(q, k_cache, v_cache, lengths, kv_len, rows=rows)
        assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() <= 4e-3, (size, start)


def test_a_short_prompt_read_beside_a_deep_long_chunk_takes_its_tile_and_gets_the_logits_it_gets_alone():
    """An eager step that reads a short prompt beside a long chunk deep into another row (a prompt sent while a 32k
    one is read) takes the long chunk's tile (`prompt_tile_rows`), each chunk laid out in runs of that tile's
    queries: both chunks' logits equal, bit for bit (batch-invariant kernels), those of each read alone."""
    from pipeline.llm.engine.model_runner import ChunkRead, ModelRunner
    from pipeline.llm.model.decoder import Decoder
    from pipeline.llm.model.invariant import make_batch_invariant
    from pipeline.llm.model.kv_cache import KVCache
    from pipeline.llm.weights.config import DecoderConfig
    from plugins import decode_attention

    config = DecoderConfig(family="qwen2", vocab_size=1024, hidden_size=1792, intermediate_size=2048, num_layers=2,
                           num_heads=28, num_kv_heads=4, head_dim=64, max_position_embeddings=16384, qkv_bias=True)
    torch.manual_seed(0)
    model = Decoder(config).to(torch.bfloat16).cuda().eval()
    assert make_batch_invariant(model) is None
    runner = ModelRunner(model, 9216, config.vocab_size, max_batch=2, use_cuda_graphs=False)
    generator = torch.Generator().manual_seed(2)
    long, short = (Prompt(tuple(torch.randint(1, 1024, (n,), generator=generator).tolist())) for n in (8704, 20))
    deep, beside = ChunkRead(long, 0, 8192, 8704, 0, logits=True), ChunkRead(short, 1, 0, 20, 0, logits=True)
    assert decode_attention.prompt_tile_rows(512, 8192) == decode_attention.LONG_TILE_ROWS
    with torch.inference_mode():
        cache = KVCache(config, 2, runner.positions, torch.bfloat16, "cuda")
        runner.step(cache, None, [ChunkRead(long, 0, 0, 8192, 0, logits=False)], graphed=False)
        alone = [runner.step(cache, None, [c], graphed=False)[1][0].clone() for c in (deep, beside)]
        together = [t.clone() for t in runner.step(cache, None, [deep, beside], graphed=False)[1]]
    runner.close()
    assert all(torch.equal(a, t) for a, t in zip(alone, together)), [(a - t).abs().max().item()
                                                                     for a, t in zip(alone, together)]


def test_the_segment_overlay_drawn_on_the_gpu_equals_the_cpu_one():
    from app.segment_render import render_overlay

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)
    mask = rng.random((300, 400)) > 0.5
    args = ([[50.0, 60.0], [200.0, 100.0]], [1, 0], [10.0, 20.0, 300.0, 250.0])
    on_gpu = render_overlay(torch.from_numpy(image).cuda(), torch.from_numpy(mask).cuda(), *args, device="cuda")
    on_cpu = render_overlay(image, mask, *args)
    assert np.abs(on_gpu.astype(int) - on_cpu).max() <= 1  # the blend may round once differently (FMA)


def test_the_sampling_kernels_draw_the_reference_tokens_at_qwens_vocabulary(monkeypatch):
    """The compiled two-kernel sampler against the torch reference at 152,064 entries: 8 rows of the UI's
    settings, greedy rows with a penalty and wide top-k rows, 20 draws each. Greedy rows always agree; a
    sampled row may differ only where a cumulative probability lies at its uniform number (float sums
    in another order): at most 2 of 160 draws (a wrong filter or order differs in most)."""
    from pipeline.llm.engine.sampling import sample, sampling_columns
    from plugins import topk_sampling

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab = 152064
    kinds = [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
             SamplingParams(temperature=0, top_k=20, repetition_penalty=1.3),
             SamplingParams(temperature=1.3, top_p=0.95, top_k=32, repetition_penalty=1.0)]
    params = [kinds[i % 3] for i in range(8)]
    assert topk_sampling.applies([p.top_k for p in params], [p.temperature for p in params], torch.device("cuda"))
    differ = 0
    for trial in range(20):
        logits = torch.randn(8, vocab, device="cuda", generator=g) * 3  # fp32: bf16 ties are ordered by id
        # here and left open by torch.topk (15 of 160 draws differed that way, H100, 2026-11-24)
        seen = torch.rand(8, vocab, device="cuda", generator=g) < 0.001
        uniforms = torch.rand(8, generator=torch.Generator().manual_seed(trial)).tolist()
        columns = torch.tensor(sampling_columns(params, uniforms, vocab), dtype=torch.float32, device="cuda")
        got = topk_sampling.sample_top_k(logits, seen, columns).tolist()
        with monkeypatch.context() as patch:  # the reference: `sample` with the kernels out of the way
            patch.setattr(topk_sampling, "applies", lambda *args: False)
            expected = sample(logits, params, seen, columns).tolist()
        assert [a for a, p in zip(got, params) if p.temperature == 0] == \
            [b for b, p in zip(expected, params) if p.temperature == 0], trial
        differ += sum(a != b for a, b in zip(got, expected))
    assert differ <= 2, differ


def test_speculation_on_gpu_keeps_greedy_replies(studio_cache, tmp_path):
    """On the GPU (CUDA graphs for the verify steps, the engine measuring them as it starts, once: a second
    engine reads the costs the first recorded and times nothing): prompt lookup and a draft model (the model
    drafting for itself, through an engine of its own) give plain decoding's greedy tokens, and drafts were
    checked and kept. fp32, so that a verify step's GEMM and a decode step's GEMV round alike (in bf16 they need
    not: `bench/RESULTS.md`, issue 32)."""
    from pipeline.llm.draft_model import DraftModel
    from pipeline.llm.engine import speculation as policy
    from pipeline.llm.engine.speculation import GPU_FLOAT, PromptLookup, Speculation, read_costs

    llm = load_language_model(demo_model_dir("demo/qwen2-tiny", studio_cache), "demo/qwen2-tiny", device="cuda",
                              dtype=torch.float32, max_context=1024)
    model, vocab = llm.engine.model, llm.tokenizer.vocab_size
    prompts = [llm.format.render([{"role": "user", "content": text * 3}]) for text in ("the moon and ", "ab cd ")]
    params = SamplingParams(max_new_tokens=64, temperature=0, repetition_penalty=1.0)

    def replies(speculation) -> tuple[list[list[int]], dict]:
        engine = TorchLLMEngine(model, 1024, vocab, max_batch=4, speculation=speculation)
        assert engine.use_cuda_graphs
        streams = [engine.submit(p, params, set()) for p in prompts]
        got = [list(s) for s in streams]
        status = engine.status()
        engine.close()
        return got, status

    plain, _ = replies(None)
    timed, measure = [], policy.fit_cost
    policy.fit_cost = lambda *args, **kwargs: timed.append(True) or measure(*args, **kwargs)
    try:
        record = tmp_path / "verify.json"
        assert replies(Speculation(PromptLookup(), GPU_FLOAT, measured=True, record=record))[0] == plain
        assert timed == [True, True] and set(read_costs(record)) == {1, policy.MAX_ROWS}, (timed, read_costs(record))
        assert replies(Speculation(PromptLookup(), GPU_FLOAT, measured=True, record=record))[0] == plain
        assert timed == [True, True], timed  # the second engine took the recorded costs, timing nothing
    finally:
        policy.fit_cost = measure
    # whether drafts pay at costs measured by the clock depends on this machine's speed (a tiny model on a fast GPU
    # is bound by its host); at the prior costs they do, and the replies stay plain decoding's
    lookup, status = replies(Speculation(PromptLookup(), GPU_FLOAT))
    assert lookup == plain and status["drafted_tokens"] > 0, status
    drafter = TorchLLMEngine(model, 1024, vocab, max_batch=4)
    drafted, status = replies(Speculation(DraftModel(drafter, "itself"), GPU_FLOAT))
    drafter.close()
    assert drafted == plain and status["accepted_tokens"] >= 0.9 * status["drafted_tokens"] > 0, status
    llm.close()


def test_a_draft_model_on_the_gpu_runs_in_the_weights_that_decode_faster(studio_cache, tmp_path):
    """On the GPU a draft model is timed in float and in int4 (`studio/draft_choice.py`), the faster kept
    and written down; the record names the measured faster one."""
    import json

    from studio.draft_choice import draft_modes, fastest_draft

    folder = demo_model_dir("demo/qwen2-tiny", studio_cache)
    loads: list[str] = []

    def load(mode: str):
        loads.append(mode)
        return load_language_model(folder, "demo/qwen2-tiny", device="cuda", dtype=torch.bfloat16, max_context=256,
                                   quant=mode, speculate="off")

    record = tmp_path / "draft.json"
    draft = fastest_draft(load, draft_modes("cuda", "none"), record, print)
    stored = json.loads(record.read_text())
    assert loads == ["none", "int4"] and stored["quant"] == max(stored["tokens_per_s"], key=stored["tokens_per_s"].get)
    assert len(list(draft.engine.submit(Prompt(tuple(range(1, 9))), GREEDY, set()))) > 0
    draft.close()


def test_qwen_vl_on_gpu_graphs_gives_transformers_greedy_reply_and_reuses_the_picture(qwen_vl_folder):  # noqa: F811
    """Qwen2.5-VL's decode rows carry their M-RoPE shift through the captured graphs (fp32 on the GPU, against
    transformers on the GPU with the same picture embeddings); a second turn finds the picture in the cache."""
    import dataclasses

    import transformers
    from test_qwen_vl_chat import IMAGES, TURNS, hf_inputs, make_processor
    from pipeline.llm.text.tokenizer import load_tokenizer
    from pipeline.pipelines.qwen_vl_chat import QwenVLChatPipeline
    from pipeline.pipelines.vlm_chat import language_model
    from pipeline.qwen_vl.preprocess import PreprocessConfig
    from pipeline.qwen_vl.text import load_text_decoder
    from pipeline.qwen_vl.weights import load_vision

    reference = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_vl_folder).cuda().eval()
    llm = language_model(load_text_decoder(qwen_vl_folder, torch.float32, "cuda"), load_tokenizer(qwen_vl_folder),
                         "tiny-qwen-vl", "cuda", 1024, 4)
    chat = QwenVLChatPipeline(load_vision(qwen_vl_folder, "cuda"), PreprocessConfig.from_folder(qwen_vl_folder), llm)
    qwen_processor = make_processor(qwen_vl_folder)
    try:
        assert chat.llm.engine.runner.use_cuda_graphs
        image = IMAGES["tall_200x90"]
        inputs = hf_inputs(qwen_processor, image, TURNS).to("cuda")
        with torch.inference_mode():
            features = reference.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
            out = reference.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        key, encoded = chat.encode_image(image)
        chat.pictures.items[key] = dataclasses.replace(encoded, embeds=(torch.cat(list(features)),))  # their picture
        ref = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        theirs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.logits, ref)]
        params = SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.0, logprobs=1)
        events = list(chat.stream(image, TURNS, params, session="s"))
        ours = [t.logprob for e in events for t in e.logprobs or []]
        assert "".join(e.text for e in events) == qwen_processor.tokenizer.decode(ref, skip_special_tokens=True)
        assert np.allclose(ours, theirs[:len(ours)], atol=1e-3), (ours, theirs)
        follow = TURNS + [{"role": "assistant", "content": "".join(e.text for e in events)},
                          {"role": "user", "content": "and?"}]
        again = list(chat.stream(image, follow, SamplingParams(max_new_tokens=4), session="s"))
        assert again[-1].stats.cached_tokens > encoded.expansion.slots[0][1]
    finally:
        chat.close()


def test_the_graph_table_is_captured_before_ready_and_serves_a_mixed_run(studio_cache):
    """On the GPU: the engine captures its table of step graphs as it starts (rows × tokens per row × prompt
    tokens, verify steps included), then a mixed run (a prompt read alone, two joining while the first decodes,
    their chunks beside its rows, drafts checked) captures nothing and runs no step eagerly for want of a
    graph; the replies are an eager engine's (fp32)."""
    from pipeline.llm.engine.speculation import GPU_FLOAT, PromptLookup, Speculation

    llm = load_language_model(demo_model_dir("demo/qwen2-tiny", studio_cache), "demo/qwen2-tiny", device="cuda",
                              dtype=torch.float32, max_context=1024)
    model, vocab = llm.engine.model, llm.tokenizer.vocab_size
    texts = ("the moon and " * 3, "ab cd " * 40, "one two three")
    prompts = [llm.format.render([{"role": "user", "content": text}]) for text in texts]
    params = SamplingParams(max_new_tokens=48, temperature=0, repetition_penalty=1.0)

    def run(graphs: bool):
        engine = TorchLLMEngine(model, 1024, vocab, max_batch=4, prefill_chunk=64, use_cuda_graphs=graphs,
                                speculation=Speculation(PromptLookup(), GPU_FLOAT, measured=True))
        first = engine.submit(prompts[0], params, set())
        next(iter(first))
        streams = [first, *(engine.submit(p, params, set()) for p in prompts[1:])]
        replies = [list(s) for s in streams]
        counts = (engine.runner.captures, len(engine.runner.table_keys()), engine.runner.missed)
        engine.close()
        return replies, counts

    graphed, (captures, table, missed) = run(True)
    assert captures == table and missed == 0, (captures, table, missed)
    assert graphed == run(False)[0]
    llm.close()


@pytest.mark.parametrize("piece", [999, 64 << 20])
def test_a_safetensors_file_read_onto_the_gpu_in_pieces_holds_what_safetensors_reads(tmp_path, monkeypatch, piece):
    """Read through pinned buffers by several threads, copies in flight on their own stream, buffers reused
    once their copies are done (999-byte pieces: thousands of reuses): every tensor as on the CPU."""
    from safetensors.torch import save_file
    from pipeline import weights_io
    from test_weight_reading import tensors

    many = tensors() | {f"layer{i}": torch.randn(37, 53 + i) for i in range(40)}
    save_file(many, str(tmp_path / "w.safetensors"))
    monkeypatch.setattr(weights_io, "PIECE", piece)
    on_gpu = weights_io.read_weight_file(tmp_path / "w.safetensors", device=torch.device("cuda"))
    on_cpu = weights_io.read_weight_file(tmp_path / "w.safetensors")
    assert on_gpu.keys() == on_cpu.keys() and all(t.is_cuda for t in on_gpu.values())
    for name, value in on_cpu.items():
        assert torch.equal(on_gpu[name].cpu().view(torch.uint8), value.view(torch.uint8)) if value.numel() and \
            value.dim() else torch.equal(on_gpu[name].cpu(), value), name


def test_a_split_k_workspace_never_grows_inside_a_capture():
    """Growing the low-bit kernels' workspace inside a CUDA graph capture raises (its counters' zeros would be
    written only when that graph replays); a size it already has is served inside one."""
    from plugins import lowbit

    workspace = lowbit.Workspace(torch.device("cuda"))
    workspace.reserve(1024, 16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        workspace.reserve(512, 8)
    with pytest.raises(RuntimeError, match="grow inside a CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            workspace.reserve(1024, 32)
    workspace.reserve(1024, 32)
    assert workspace.counters.numel() == 32 and int(workspace.counters.abs().sum()) == 0


def test_a_step_capture_that_fails_is_retried_after_a_warm_up_and_a_failed_table_leaves_eager_steps(studio_cache):
    """Only the graph table's first step runs once outside its graph before capture (the others' runs cost as
    much as their captures); a later capture that meets lazy set-up (here a synchronize, refused while
    capturing) is captured again after a warm-up run, and the table completes. Where the first capture
    fails, the engine warns and runs its steps eagerly. The replies are an eager engine's (fp32)."""
    llm = load_language_model(demo_model_dir("demo/qwen2-tiny", studio_cache), "demo/qwen2-tiny", device="cuda",
                              dtype=torch.float32, max_context=1024)
    model, vocab = llm.engine.model, llm.tokenizer.vocab_size
    prompt = llm.format.render([{"role": "user", "content": "the moon and " * 5}])
    params = SamplingParams(max_new_tokens=24, temperature=0, repetition_penalty=1.0)
    failing_at: list[int] = []

    def lazy_set_up(module, args):  # a first call that must not happen inside a capture
        engine = engines[-1]
        if torch.cuda.is_current_stream_capturing() and engine.runner.captures in failing_at:
            failing_at.remove(engine.runner.captures)
            torch.cuda.synchronize()

    hook = model.register_forward_pre_hook(lazy_set_up)
    engines: list[TorchLLMEngine] = []

    def run(graphs: bool, fail_at: int | None = None):
        failing_at[:] = [] if fail_at is None else [fail_at]
        engines.append(TorchLLMEngine(model, 1024, vocab, max_batch=4, prefill_chunk=64, use_cuda_graphs=graphs))
        engine = engines[-1]
        reply = list(engine.submit(prompt, params, set()))
        counts = (engine.runner.captures, len(engine.runner.table_keys()), engine.runner.missed, list(failing_at))
        engine.close()
        return reply, counts

    try:
        eager, _ = run(False)
        retried, (captures, table, missed, left) = run(True, fail_at=3)
        assert left == [] and captures == table and missed == 0, (captures, table, missed, left)
        assert retried == eager
        with pytest.warns(UserWarning, match="capturing the step graphs failed"):
            unwarmed, (captures, table, missed, left) = run(True, fail_at=0)
        assert left == [] and captures == 0 and missed > 0, (captures, table, missed, left)
        assert unwarmed == eager
    finally:
        hook.remove()
        llm.close()


def test_batch_invariant_mode_gives_a_chat_the_same_logits_alone_and_beside_others_in_any_chunks():
    """bf16, CUDA graphs: six prompts (40–400 tokens) read and answered together, in chunks of 32 beside the
    others' decode rows, give every token's logits bit for bit as each read alone (in chunks of 256, one row
    decoding); without the mode they do not (the decode attention's splits follow the batch)."""
    from pipeline.llm.weights.config import DecoderConfig
    from pipeline.llm.model.decoder import Decoder
    from pipeline.llm.model.invariant import make_batch_invariant

    config = DecoderConfig(family="qwen2", vocab_size=2048, hidden_size=1024, intermediate_size=2816, num_layers=3,
                           num_heads=16, num_kv_heads=2, head_dim=64, max_position_embeddings=2048, qkv_bias=True)
    params = SamplingParams(max_new_tokens=24, temperature=0, repetition_penalty=1.0)
    generator = torch.Generator().manual_seed(1)
    prompts = [Prompt(tuple(torch.randint(1, 2048, (n,), generator=generator).tolist()))
               for n in (40, 400, 130, 257, 75, 333)]

    def logits(invariant: bool) -> tuple[list, list]:
        torch.manual_seed(0)
        model = Decoder(config).to(torch.bfloat16).cuda().eval()
        if invariant:
            assert make_batch_invariant(model) is None
        engine = TorchLLMEngine(model, 2048, config.vocab_size, max_batch=8, prefill_chunk=32)
        alone = []
        for p in prompts:
            stream = engine.submit(p, params, set(), keep_logits=True)
            alone.append((list(stream), stream.logits))
        engine.close()  # a fresh engine: the first one's rows hold these prompts (it would read none of them again)
        engine = TorchLLMEngine(model, 2048, config.vocab_size, max_batch=8, prefill_chunk=32)
        streams = [engine.submit(p, params, set(), keep_logits=True) for p in prompts]
        together = [(list(s), s.logits) for s in streams]
        engine.close()
        return alone, together

    def same(a, b) -> bool:
        return a[0] == b[0] and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))

    alone, together = logits(invariant=True)
    assert all(len(tokens) == 24 for tokens, _ in alone)
    assert [same(a, b) for a, b in zip(alone, together)] == [True] * 6
    alone, together = logits(invariant=False)
    assert not all(same(a, b) for a, b in zip(alone, together)), "the default kernels became batch-invariant"


WORKER_CASES = """
import torch
from plugins.precompile import attention_calls, sampling_calls
device = torch.device("cuda", torch.cuda.current_device())
cases = sampling_calls((4099,), torch.float16, device) + attention_calls(6, 2, 64, torch.float16, device, verify=True)
"""


def test_kernels_compiled_in_worker_processes_are_read_from_the_cache_here(tmp_path, monkeypatch):
    """A launch's kernels (here the sampler's and the attention's for a shape no other test uses) are
    compiled by worker processes into an empty Triton cache: this process reads every one of them from
    it and compiles none itself; a second launch (a process of its own) starts no worker."""
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    from triton import knobs
    from plugins.precompile import compile_now

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    scope: dict = {}
    exec(WORKER_CASES, scope)
    hits, said = [], []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    free_before = torch.cuda.mem_get_info()[0]
    asked = compile_now(scope["cases"], said.append, "test kernels")
    assert asked >= 6 and len(hits) == asked, said
    assert all(hits), f"{hits.count(False)} of {asked} compiled in this process: {said}"
    # the workers compiled more: every merge width the attention can launch, which this process reads at need
    in_workers = [int(m.group(1)) for line in said if (m := re.match(r"compiling (\d+) test kernels in worker processes", line))]
    assert in_workers and in_workers[0] >= asked, said
    assert torch.cuda.mem_get_info()[0] > free_before - 256 * 2**20, "the compile workers hold GPU memory"

    again = WORKER_CASES + "said = []\nfrom plugins.precompile import compile_now\n" \
        "compile_now(cases, said.append, 'test kernels')\nimport json; print(json.dumps(said))"
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", again], cwd=root, capture_output=True, text=True, timeout=300)
    said_again = json.loads(run.stdout.strip().splitlines()[-1])
    assert not any("worker processes" in line for line in said_again), said_again
    assert any(line.startswith(f"compiled {asked} test kernels in") for line in said_again), said_again
    from plugins.compile_workers import has_gpu
    assert has_gpu(0), "a launch here would not start its compile workers early (`start_early`)"


FIRST_REPLY = """
import json, sys, threading, torch
from triton import knobs
from pipeline.llm.demo import demo_model_dir
from studio.backends import load_language_model

asked = []
def note(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
    asked.append([threading.current_thread().name, fn.module, fn.name])
knobs.runtime.jit_cache_hook = note
name = "demo/qwen2-tiny"
for quant in ("none", "int4"):
    load_language_model(demo_model_dir(name, sys.argv[1]), name, device="cuda", dtype=torch.bfloat16, max_context=512,
                        quant=quant).engine.close()
print(json.dumps(asked))
"""


def test_the_fused_kernels_compile_ahead_not_in_the_first_steps(studio_cache):
    """A load on a fresh process, float and int4 weights: the norms, RoPE and SiLU kernels of `plugins.fused`
    compile before the engine runs (`plugins.precompile.fused_calls`); the warm-up reply's steps on the
    engine's thread ask for none of them (they took 1–2 s there, one at a time, H200 2026-11-30)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    demo_model_dir("demo/qwen2-tiny", studio_cache)
    run = subprocess.run([sys.executable, "-c", FIRST_REPLY, str(studio_cache)], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=600)
    asked = json.loads(run.stdout.strip().splitlines()[-1])
    fused = [(thread, name) for thread, module, name in asked if module == "plugins.fused"]
    assert fused and not [f for f in fused if f[0] == "llm-engine"], fused
