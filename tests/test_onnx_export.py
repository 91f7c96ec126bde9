"""The exported vision graphs, built into ONNX Runtime engines, against the torch modules on the same
random weights: SAM's encoder, SAM's decoder for 1, 2 and 5 points with and without a box and a
previous mask (and a batch of prompts, as segment-everything sends), MiniGPT-4's vision side."""

import itertools

import pytest
import torch

from engine_builder import onnxruntime_backend
from engine_builder.onnx_export import export_onnx, minigpt4_graph, sam_graphs
from pipeline.sam.engine import SessionSamEngine
from pipeline.minigpt4.vision import TINY, MiniGPT4Vision
from pipeline.random_weights import spread_weights
from pipeline.sam.engine import TorchSamEngine
from pipeline.sam.model import VARIANTS, Sam
from pipeline.sam.prompt_encoder import labelled_points

RTOL = 1e-3


def rel_err(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())


def built(graph, module, tmp_path) -> onnxruntime_backend.OrtSession:
    """Export `graph` and build it into an ONNX Runtime engine, as the engine cache does."""
    folder = tmp_path / graph.component
    folder.mkdir()
    export_onnx(graph, module, tmp_path / f"{graph.component}.onnx")
    onnxruntime_backend.build(tmp_path / f"{graph.component}.onnx", folder, graph, "float32")
    return onnxruntime_backend.OrtSession(folder)


@pytest.fixture(scope="module")
def sam():
    return spread_weights(lambda: Sam(VARIANTS["demo"]), seed=11).eval()


@pytest.fixture(scope="module")
def sam_engines(sam, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sam-onnx")
    encoder, decoder = (built(g, sam, tmp) for g in sam_graphs(sam.config))
    return SessionSamEngine(sam.config, encoder, decoder, "onnxruntime engine", "float32")


def test_sam_encoder_matches_torch(sam, sam_engines):
    pixels = torch.randn(1, 3, 1024, 1024)
    with torch.inference_mode():
        reference = sam.image_encoder(pixels)
    assert rel_err(sam_engines.encode(pixels), reference) <= RTOL


@pytest.mark.parametrize("points,box,mask", list(itertools.product([1, 2, 5], [False, True], [False, True])))
def test_sam_decoder_matches_torch(sam, sam_engines, points, box, mask):
    gen = torch.Generator().manual_seed(points * 4 + box * 2 + mask)
    embedding = torch.randn(1, 32, 64, 64, generator=gen)
    prompt = (torch.rand(1, points, 2, generator=gen) * 1000, torch.randint(0, 2, (1, points), generator=gen))
    box_arg = torch.tensor([[120.0, 80.0, 700.0, 900.0]]) if box else None
    mask_arg = torch.randn(1, 1, 256, 256, generator=gen) * 4 if mask else None
    for multimask in (True, False):
        ours = sam_engines.decode(embedding, prompt, box_arg, mask_arg, multimask)
        reference = TorchSamEngine(sam).decode(embedding, prompt, box_arg, mask_arg, multimask)
        assert ours[0].shape == reference[0].shape == (1, 3 if multimask else 1, 256, 256)
        assert rel_err(ours[0], reference[0]) <= RTOL and rel_err(ours[1], reference[1]) <= RTOL


def test_sam_decoder_takes_a_batch_of_prompts(sam, sam_engines):
    """Segment-everything sends 64 single-point prompts at once: the batch axis is dynamic."""
    embedding = torch.randn(1, 32, 64, 64)
    prompt = (torch.rand(64, 1, 2) * 1000, torch.ones(64, 1, dtype=torch.int64))
    ours = sam_engines.decode(embedding, prompt, None, None, True)
    reference = TorchSamEngine(sam).decode(embedding, prompt, None, None, True)
    assert ours[0].shape == (64, 3, 256, 256)
    assert rel_err(ours[0], reference[0]) <= RTOL and rel_err(ours[1], reference[1]) <= RTOL


def test_labelled_points_follow_the_official_onnx_convention():
    """Points, then a padding point (label -1) without a box, or the box corners (labels 2, 3)."""
    pts = (torch.tensor([[[10.0, 20.0], [30.0, 40.0]]]), torch.tensor([[1, 0]]))
    coords, labels = labelled_points(pts, None)
    assert labels.tolist() == [[1.0, 0.0, -1.0]] and coords[0, 2].tolist() == [0.0, 0.0]
    coords, labels = labelled_points(pts, torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert labels.tolist() == [[1.0, 0.0, 2.0, 3.0]] and coords[0, 2:].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert labelled_points(None, None) is None


def test_minigpt4_vision_matches_torch(tmp_path):
    model = spread_weights(lambda: MiniGPT4Vision(TINY), seed=5).eval()
    session = built(minigpt4_graph(model.config), model, tmp_path)
    pixels = torch.randn(1, 3, 224, 224)
    with torch.inference_mode():
        reference = model(pixels)
    (ours,) = session.run({"pixels": pixels})
    assert ours.shape == reference.shape == (1, 32, TINY.llm_width)
    assert rel_err(ours, reference) <= RTOL


def test_mobile_sams_tinyvit_encoder_builds_into_an_engine_that_matches_torch(tmp_path):
    """MobileSAM's image encoder (TinyViT: convolutions, batch norm, window attention with learned biases)
    through the same export and engine build as SAM's ViT, at its real shapes."""
    mobile = spread_weights(lambda: Sam(VARIANTS["mobile_sam"]), seed=11).eval()
    encoder_graph = next(g for g in sam_graphs(mobile.config) if g.component.endswith("encoder"))
    engine = built(encoder_graph, mobile, tmp_path)
    pixels = torch.randn(1, 3, 1024, 1024, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = mobile.image_encoder(pixels)
    assert rel_err(engine.run({"pixels": pixels})[0], reference) <= RTOL
