"""Qwen2.5-VL's vision side against transformers on one tiny random checkpoint (fp32).

The reference processor is `Qwen2VLImageProcessorPil` (the default one needs torchvision, which this
venv does not have). The tower is small but shaped like the real one: 14-pixel patches, 2 × 2 merge
cells, windows of 3 × 3 cells (partial at the right and bottom edges), full attention in blocks 1 and 3.
"""

import copy
import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
pil_processing = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

from pipeline.errors import UserError  # noqa: E402
from pipeline.qwen_vl.preprocess import PreprocessConfig, preprocess, token_count  # noqa: E402
from pipeline.qwen_vl.vision import QwenVLVision, VisionConfig  # noqa: E402
from pipeline.qwen_vl.weights import config_from_hf, load_vision, read_vision_tensors, to_ours  # noqa: E402

CELL = 28  # patch 14 × merge 2
MIN_PIXELS, MAX_PIXELS = CELL * CELL * 4, CELL * CELL * 40
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
RNG = np.random.default_rng(0)
IMAGES = {  # height × width, odd sizes: wide, tall past max_pixels, tiny (upscaled), grayscale, square-ish
    "37x300": RNG.integers(0, 256, (37, 300, 3), dtype=np.uint8),
    "1000x513": RNG.integers(0, 256, (1000, 513, 3), dtype=np.uint8),
    "20x20": RNG.integers(0, 256, (20, 20, 3), dtype=np.uint8),
    "gray_50x90": RNG.integers(0, 256, (50, 90), dtype=np.uint8),
    "130x150": RNG.integers(0, 256, (130, 150, 3), dtype=np.uint8),
}
GRIDS = {"37x300": (1, 2, 22), "1000x513": (1, 16, 8), "20x20": (1, 4, 4), "gray_50x90": (1, 4, 6),
         "130x150": (1, 10, 10)}


def as_uploaded(image: np.ndarray) -> np.ndarray | Image.Image:
    """What the processor is given: the array, a grayscale one as the PIL image it came from."""
    return Image.fromarray(image) if image.ndim == 2 else image


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def model():
    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(depth=4, hidden_size=32, num_heads=4, intermediate_size=64, out_hidden_size=48,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=3 * CELL,
                           fullatt_block_indexes=[1, 3]),
        text_config=dict(vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 1], "rope_theta": 1e4}),
        image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # a trained-like spread: norms not all 1, biases not 0, attention that is not flat
        for name, p in model.model.visual.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "qkv" in name:
                p.normal_(0, 0.3)  # peaked attention: positions and windows change the output
            else:
                p.normal_(0, p[0].numel() ** -0.5)
    return model


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    """As `save_pretrained` writes one (sharded, with an index), plus the hub's preprocessor_config.json."""
    path = tmp_path_factory.mktemp("qwen_vl")
    model.save_pretrained(path, max_shard_size="100KB")
    (path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": MEAN, "image_std": STD, "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor"}))
    return path


@pytest.fixture(scope="module")
def memory_layout(model, folder, tmp_path_factory):
    """The same model under `state_dict()`'s names (`model.visual.…`, `model.language_model.…`), one file."""
    path = tmp_path_factory.mktemp("qwen_vl_state_dict")
    shutil.copy(folder / "config.json", path / "config.json")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def processor(folder):
    return pil_processing.Qwen2VLImageProcessorPil.from_pretrained(folder)


@pytest.fixture(scope="module")
def ours(folder):
    return PreprocessConfig.from_folder(folder), load_vision(folder)


@pytest.mark.parametrize("name", IMAGES)
def test_pixels_match_the_processor(processor, ours, name):
    ref = processor(as_uploaded(IMAGES[name]), return_tensors="pt")
    got = preprocess(IMAGES[name], ours[0])
    assert got.grid == tuple(ref["image_grid_thw"][0].tolist()) == GRIDS[name]
    assert got.pixels.dtype == torch.float32 and got.pixels.shape == ref["pixel_values"].shape
    assert (got.pixels - ref["pixel_values"]).abs().max().item() <= 1e-6


def test_sizes_cover_the_cases(ours):
    """Downscaled to max_pixels, upscaled to min_pixels, and rounded to cells in between."""
    pixels = {name: grid[1] * grid[2] * 14 * 14 for name, grid in GRIDS.items()}
    assert pixels["1000x513"] <= MAX_PIXELS < 1008 * 504
    assert pixels["20x20"] >= MIN_PIXELS > 28 * 28
    assert MIN_PIXELS <= pixels["37x300"] <= MAX_PIXELS and pixels["37x300"] == 28 * 308


def test_token_count_matches_the_processor(processor, ours):
    for name, image in IMAGES.items():
        grid = preprocess(image, ours[0]).grid
        assert token_count(grid) == processor.get_number_of_image_patches(*image.shape[:2]) // 4
        assert token_count((2, *grid[1:])) == 2 * token_count(grid)


def test_config_file_variants_mean_what_the_processor_reads(tmp_path):
    hub = {"min_pixels": 1000, "max_pixels": 50000, "image_mean": [0.5] * 3, "image_std": [0.25] * 3}
    newer = {"size": {"shortest_edge": 1000, "longest_edge": 50000}, "image_mean": [0.5] * 3, "image_std": [0.25] * 3}
    for i, content in enumerate([hub, newer, {"image_processor": hub}]):
        (tmp_path / str(i)).mkdir()
        name = "processor_config.json" if "image_processor" in content else "preprocessor_config.json"
        (tmp_path / str(i) / name).write_text(json.dumps(content))
        c = PreprocessConfig.from_folder(tmp_path / str(i))
        assert (c.min_pixels, c.max_pixels, c.image_mean, c.image_std) == (1000, 50000, (0.5,) * 3, (0.25,) * 3)
    defaults, ref = PreprocessConfig.from_folder(tmp_path / "none"), pil_processing.Qwen2VLImageProcessorPil()
    assert (defaults.min_pixels, defaults.max_pixels) == (ref.size["shortest_edge"], ref.size["longest_edge"])
    assert (defaults.image_mean, defaults.image_std) == (tuple(ref.image_mean), tuple(ref.image_std))
    assert (defaults.patch_size, defaults.temporal_patch_size, defaults.merge_size, defaults.resample) == \
        (ref.patch_size, ref.temporal_patch_size, ref.merge_size, ref.resample)
    assert defaults.rescale_factor == ref.rescale_factor


def hf_embeddings(model, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output


@pytest.mark.parametrize("name", IMAGES)
def test_embeddings_match_transformers(model, ours, name):
    patches = preprocess(IMAGES[name], ours[0])
    with torch.inference_mode():
        got = ours[1](patches.pixels, patches.grid)
    ref = hf_embeddings(model, patches.pixels, [patches.grid])
    assert got.shape == ref.shape == (token_count(patches.grid), 48)
    assert rel_err(got, ref) <= 1e-5


def test_several_images_and_frames_match_transformers(model, ours):
    """Images one after another (full attention stays within each) and a two-frame grid (a video's)."""
    first, second = (preprocess(IMAGES[name], ours[0]) for name in ("1000x513", "37x300"))
    frames = torch.randn(2 * 6 * 10, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    pixels = torch.cat([first.pixels, second.pixels, frames])
    grids = [first.grid, second.grid, (2, 6, 10)]
    with torch.inference_mode():
        got = ours[1](pixels, grids)
        alone = ours[1](first.pixels, first.grid)
    assert rel_err(got, hf_embeddings(model, pixels, grids)) <= 1e-5
    assert rel_err(got[:len(alone)], alone) <= 1e-6  # another image in the batch changes nothing


def test_float64_matches_transformers_to_rounding(model, folder, ours):
    """In float64 the fp32 noise (a Conv3d against our matmul, amplified by peaked attention) is gone:
    what remains must be rounding, so any real difference shows far above it."""
    patches = [preprocess(IMAGES[name], ours[0]) for name in ("130x150", "37x300")]
    pixels, grids = torch.cat([p.pixels for p in patches]).double(), [p.grid for p in patches]
    with torch.inference_mode():
        got = load_vision(folder, dtype=torch.float64)(pixels, grids)
        ref = copy.deepcopy(model.model.visual).double()(pixels, grid_thw=torch.tensor(grids)).pooler_output
    assert got.dtype == torch.float64 and rel_err(got, ref) <= 1e-12


def test_both_key_layouts_load(folder, memory_layout, ours):
    on_disk = load_file(str(next(folder.glob("*.safetensors"))))
    assert all(not k.startswith("model.visual.") for k in on_disk)  # save_pretrained writes the hub's names
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded: read through the index
    assert any(k.startswith("model.visual.") for k in load_file(str(memory_layout / "model.safetensors")))
    state = load_vision(memory_layout).state_dict()
    assert state.keys() == ours[1].state_dict().keys()
    assert all(torch.equal(v, ours[1].state_dict()[k]) for k, v in state.items())


def test_a_pytorch_bin_loads_too(memory_layout, ours, tmp_path):
    shutil.copy(memory_layout / "config.json", tmp_path / "config.json")
    torch.save(load_file(str(memory_layout / "model.safetensors")), tmp_path / "pytorch_model.bin")
    state = load_vision(tmp_path).state_dict()
    assert all(torch.equal(v, ours[1].state_dict()[k]) for k, v in state.items())


def test_names_map_onto_every_vision_tensor_and_only_those(folder):
    mapped = to_ours(read_vision_tensors(folder))
    assert set(mapped) == set(QwenVLVision(config_from_hf(json.loads((folder / "config.json").read_text()))).state_dict())


def test_config_of_qwen25_vl_7b():
    """Qwen2.5-VL-7B-Instruct's config.json vision_config, as the hub ships it (old key names included)."""
    c = config_from_hf({"model_type": "qwen2_5_vl", "vision_config": {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
        "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2}})
    assert c == VisionConfig() and c.window_cells == 4 and c.patch_dim == 1176


def edited_copy(source, tmp_path, edit) -> None:
    """`source` (one safetensors file) copied into tmp_path with its tensors passed through `edit`."""
    shutil.copy(source / "config.json", tmp_path / "config.json")
    save_file(edit(load_file(str(source / "model.safetensors"))), str(tmp_path / "model.safetensors"))


def test_missing_tensor_is_named(memory_layout, tmp_path):
    edited_copy(memory_layout, tmp_path, lambda t: {k: v for k, v in t.items() if k != "model.visual.blocks.2.mlp.up_proj.bias"})
    with pytest.raises(UserError, match=r"lack 1 vision tensors, e\.g\. blocks\.2\.mlp\.up_proj\.bias"):
        load_vision(tmp_path)


def test_wrong_shape_is_named(memory_layout, tmp_path):
    edited_copy(memory_layout, tmp_path, lambda t: t | {"model.visual.merger.mlp.2.weight": torch.zeros(40, 128)})
    with pytest.raises(UserError, match=r"merger\.fc2\.weight is \(40, 128\).*\(48, 128\)"):
        load_vision(tmp_path)


def test_unknown_tensors_are_named(memory_layout, tmp_path):
    edited_copy(memory_layout, tmp_path, lambda t: t | {"model.visual.pos_embed.weight": torch.zeros(4)})
    with pytest.raises(UserError, match=r"does not know, e\.g\. model\.visual\.pos_embed\.weight"):
        load_vision(tmp_path)
    edited_copy(memory_layout, tmp_path, lambda t: t | {"model.visual.blocks.4.norm1.weight": torch.zeros(32)})
    with pytest.raises(UserError, match=r"no place for, e\.g\. blocks\.4\.norm1\.weight"):
        load_vision(tmp_path)


@pytest.mark.parametrize("cfg", [{"model_type": "idefics3"}, {"model_type": "qwen2_vl"}, {},
                                 {"model_type": "qwen2_5_vl", "vision_config": {"hidden_act": "quick_gelu"}}])
def test_other_configs_are_refused(cfg):
    with pytest.raises(UserError):
        config_from_hf(cfg)


@pytest.mark.parametrize("image, message", [
    (np.zeros((0, 40, 3), np.uint8), "empty"),
    (np.zeros((2, 500, 3), np.uint8), "more than 200 times"),
    (np.zeros((20, 20, 3), np.float32), "uint8"),
    (np.zeros((20, 20, 4), np.uint8), "uint8"),
])
def test_bad_images_are_refused(ours, image, message):
    with pytest.raises(UserError, match=message):
        preprocess(image, ours[0])


def test_no_min_pixels_cannot_round_an_image_away(ours):
    with pytest.raises(UserError, match="too small"):
        preprocess(np.zeros((10, 20, 3), np.uint8), dataclasses.replace(ours[0], min_pixels=0))
