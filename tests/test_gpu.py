"""The pipelines on a CUDA GPU, as `launch.py` runs them there (bf16, CUDA graphs).

Skipped without a GPU (CI has none); run on the lent H100 with `python3 -m pytest tests/test_gpu.py`.
Each graphed path is checked against the same computation run eagerly.
"""

import numpy as np
import pytest
import torch
from PIL import Image

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the CPU paths are covered by the other tests)", allow_module_level=True)

from pipeline.chat import ChatPipeline  # noqa: E402
from pipeline.image_chat import ImageChatPipeline  # noqa: E402
from pipeline.images import load_image  # noqa: E402
from pipeline.llm.demo import demo_model_dir  # noqa: E402
from pipeline.llm.generate import Generator  # noqa: E402
from pipeline.llm.sampling import SamplingParams  # noqa: E402
from pipeline.minigpt4.weights import demo_vision_dir, load_vision_folder  # noqa: E402
from pipeline.sam.weights import resolve_sam  # noqa: E402
from pipeline.segment import SegmentPipeline  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=300, temperature=0, repetition_penalty=1.0)


@pytest.mark.parametrize("name", ["demo/qwen-v1-tiny", "demo/qwen2-tiny"])
def test_chat_on_gpu_graphs_match_eager(studio_cache, name):
    pipe = ChatPipeline(demo_model_dir(name, studio_cache), name, device="cuda", dtype=torch.bfloat16,
                        max_context=1024)
    assert pipe.llm.generator.use_cuda_graphs
    prompt = pipe.format.render([{"role": "user", "content": "Hello 你好"}])
    graphed = list(pipe.llm.generator.stream(GREEDY, set(), prompt_ids=prompt))  # crosses a 256-token bucket
    eager = list(Generator(pipe.llm.model, 1024, use_cuda_graphs=False).stream(GREEDY, set(), prompt_ids=prompt))
    assert graphed == eager and len(graphed) == 300
    pipe = ChatPipeline(demo_model_dir(name, studio_cache), name, device="cuda", dtype=torch.bfloat16,
                        max_context=1024)
    events = list(pipe.stream([{"role": "user", "content": "Hi"}], SamplingParams(max_new_tokens=20, seed=3)))
    assert events[-1].stats.new_tokens > 0


def test_image_chat_on_gpu(studio_cache):
    llm = demo_model_dir("demo/llama-tiny", studio_cache)
    vision_dir = demo_vision_dir(studio_cache, llm_width=64)
    vision = load_vision_folder(vision_dir / "prerained_minigpt4_7b.pth", vision_dir, "cuda", torch.bfloat16)
    pipe = ImageChatPipeline(vision, llm, "demo/llama-tiny", device="cuda", dtype=torch.bfloat16)
    photo = load_image("assets/examples/fruit_bowl.jpg")
    graphed = pipe.encode_image(photo)
    with torch.inference_mode():
        eager = pipe.vision(pipe.preprocess(photo).to("cuda", torch.bfloat16))[0]
    assert torch.equal(graphed, eager)
    first = list(pipe.stream(photo, [{"role": "user", "content": "What is it?"}], SamplingParams(max_new_tokens=12)))
    answer = "".join(e.text for e in first)
    second = list(pipe.stream(photo, [{"role": "user", "content": "What is it?"},
                                      {"role": "assistant", "content": answer},
                                      {"role": "user", "content": "Why?"}], SamplingParams(max_new_tokens=12)))
    assert second[-1].stats.prompt_tokens > first[-1].stats.prompt_tokens and pipe.encoder_runs == 1


def test_segment_on_gpu_graphs_match_eager(studio_cache):
    seg = SegmentPipeline(resolve_sam("demo/sam-tiny", studio_cache), device="cuda", dtype=torch.bfloat16)
    photo = load_image("assets/examples/shapes.jpg")
    handle = seg.set_image(photo)
    with torch.inference_mode():
        pixels = torch.from_numpy(np.array(Image.fromarray(photo).resize((1024, 768), Image.BILINEAR))).cuda()
        eager = seg.model.image_encoder(seg.model.preprocess(pixels.permute(2, 0, 1)).to(torch.bfloat16)).float()
    assert torch.equal(seg._embedding(handle), eager)  # the replayed encoder graph
    for points, labels, box in [([[100, 200]], [1], None), ([[100, 200], [500, 300]], [1, 0], None),
                                ([[100, 200]], [1], [50, 50, 400, 400]), ([], [], [50, 50, 400, 400])]:
        for _ in range(2):  # capture, then replay
            result = seg.predict(handle, points, labels, box)
        with torch.inference_mode():
            embedding = seg._embedding(handle)
            scale = torch.tensor([1024 / 800, 768 / 600], device="cuda")
            pts = (torch.tensor([points], device="cuda") * scale, torch.tensor([labels], device="cuda")) \
                if points else None
            bx = (torch.tensor([box], device="cuda").view(1, 2, 2) * scale).view(1, 4) if box else None
            low, _ = seg.model.decode(embedding, pts, bx, None, True)
        assert np.array_equal(result.low_res_logits, low[0].float().cpu().numpy())
        assert result.masks.shape == (3, 600, 800)
    assert seg.stats.encoder_runs == 1
    assert isinstance(seg.segment_everything(handle, points_per_side=8), list)


def test_fused_kernels_match_the_torch_reference():
    from plugins.fused import (rms_norm, rms_norm_reference, rotary_, rotary_reference, silu_mul,
                               silu_mul_reference)

    def close(a, b, tol):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        return rel <= tol and (a == b).float().mean().item() > 0.9

    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (64, 3584, 4096):  # demo, Qwen2.5-7B and Qwen-7B widths
        x = torch.randn(5, n, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
        assert close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), 1e-3)
    for n in (128, 11008, 18944):
        gu = torch.randn(3, 2 * n, device="cuda", dtype=torch.bfloat16, generator=g)
        assert close(silu_mul(gu), silu_mul_reference(gu), 1e-3)
    qkv = torch.randn(1, 6, (32 + 2 * 4) * 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q = qkv[..., :32 * 128].view(1, 6, 32, 128)  # a strided view, as in the decoder
    cos, sin = torch.randn(6, 128, device="cuda", generator=g), torch.randn(6, 128, device="cuda", generator=g)
    expected = rotary_reference(q.clone(), cos[:, None].to(q.dtype), sin[:, None].to(q.dtype))
    out = rotary_(q, cos, sin)
    assert out.data_ptr() == q.data_ptr()  # in place
    assert ((out.float() - expected.float()).norm() / expected.float().norm()).item() <= 4e-3
