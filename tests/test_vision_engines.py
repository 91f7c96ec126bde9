"""The torch vision engines on the CPU: the seam adds nothing to the models' own results."""

import torch

from pipeline.minigpt4.engine import TorchVisionEncoder
from pipeline.minigpt4.weights import demo_vision_dir, load_vision_folder
from pipeline.sam.engine import TorchSamEngine, torch_sam_engine
from pipeline.sam.model import load_sam
from pipeline.sam.weights import resolve_sam


def test_minigpt4_encoder_equals_the_model(studio_cache):
    vision_dir = demo_vision_dir(studio_cache, llm_width=64)
    model = load_vision_folder(vision_dir / "prerained_minigpt4_7b.pth", vision_dir)
    encoder = TorchVisionEncoder(model)
    pixels = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(pixels)[0]
    assert encoder.name == "torch (CPU)" and encoder.config is model.config
    assert torch.equal(encoder.encode(pixels), expected) and expected.shape == (32, 64)


def test_sam_engine_equals_the_model(studio_cache):
    model = load_sam(resolve_sam("demo/sam-tiny", studio_cache))
    engine = torch_sam_engine(model)
    assert type(engine) is TorchSamEngine and engine.name == "torch (CPU)" and engine.precision == "float32"
    pixels = torch.randn(1, 3, 1024, 1024, generator=torch.Generator().manual_seed(0))
    points = (torch.tensor([[[500.0, 375.0], [100.0, 80.0]]]), torch.tensor([[1, 0]]))
    with torch.inference_mode():
        embedding = model.image_encoder(pixels)
        expected = model.decode(embedding, points, None, None, True)
    assert torch.equal(engine.encode(pixels), embedding)
    assert all(torch.equal(a, b) for a, b in zip(engine.decode(embedding, points, None, None, True), expected))
