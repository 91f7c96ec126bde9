"""SegmentPipeline on the demo SAM: caching, prompts at original size, bad input; image loading."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from official_sam import official_sam_modules
from pipeline.errors import UserError
from pipeline.images import fit_for_display, load_image
from app.segment_render import mask_png, render_candidates, render_everything, render_overlay, shrink, thumbnail
from pipeline.sam.engine import TorchSamEngine
from pipeline.sam.model import load_sam
from pipeline.sam.transforms import input_size, preprocess
from pipeline.sam.weights import resolve_sam
from pipeline.pipelines.segment import SegmentPipeline, SegmentStats
from pipeline.pipelines.segment_session import SegmentSession


@pytest.fixture(scope="module")
def checkpoint(studio_cache):
    return resolve_sam("demo/sam-tiny", studio_cache)


@pytest.fixture(scope="module")
def seg(checkpoint):
    return SegmentPipeline(TorchSamEngine(load_sam(checkpoint)), is_demo=True)


@pytest.fixture(scope="module")
def photo():
    return load_image("assets/examples/shapes.jpg")  # 800×600


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_input_size_follows_the_longest_side():
    assert input_size((600, 800), 1024) == (768, 1024)
    assert input_size((1200, 900), 1024) == (1024, 768)
    assert input_size((3, 2000), 1024) == (2, 1024)


def test_preprocessing_matches_official(checkpoint):
    official_sam_modules()
    from segment_anything.modeling import Sam as OfficialSam

    pixels = torch.randint(0, 256, (3, 768, 1024)).float()
    official = OfficialSam.preprocess(load_sam(checkpoint), pixels[None])  # the official method, SAM's constants
    assert torch.allclose(preprocess(pixels, 1024), official)


def test_encoder_runs_once_per_image(checkpoint, photo):
    seg = SegmentPipeline(TorchSamEngine(load_sam(checkpoint)))
    stats = SegmentStats()
    handle = seg.set_image(photo, stats)
    for points, labels in ([[100, 200]], [1]), ([[100, 200], [500, 300]], [1, 0]):
        result = seg.predict(handle, points, labels, stats=stats)
        assert result.masks.shape == (3, 600, 800) and result.masks.dtype == bool
        assert result.scores.shape == (3,) and result.low_res_logits.shape == (3, 256, 256)
    assert seg.set_image(photo.copy(), stats).key == handle.key  # same content, same embedding
    assert stats.encoder_runs == 1 and stats.cache_hits == 3
    assert stats.last_encoder_ms > 0 and stats.last_decoder_ms > 0


def test_the_factory_picks_the_cpu_engine(checkpoint, photo, tmp_path):
    from engine_builder.build import EngineOptions
    from studio.startup_report import StartupReport
    from engine_builder.cache import EngineCache
    from studio.backends import sam_engine

    seg = SegmentPipeline(sam_engine(load_sam(checkpoint)), is_demo=True)
    assert isinstance(seg.engine, TorchSamEngine) and "torch (CPU)" in seg.description
    assert seg.predict(seg.set_image(photo), [[100, 200]], [1]).masks.shape == (3, 600, 800)
    options = EngineOptions(EngineCache(tmp_path), StartupReport(out=None))
    fallback = sam_engine(seg.engine.model, "tensorrt", checkpoint, options)  # no TensorRT, no GPU here
    assert isinstance(fallback, TorchSamEngine)
    assert options.report.lines == ["segment: the tensorrt engine failed (no CUDA GPU); running on torch instead"]


def test_box_single_mask_and_refinement(seg, photo):
    handle = seg.set_image(photo)
    first = seg.predict(handle, box=[80, 120, 330, 370], multimask=False)
    assert first.masks.shape == (1, 600, 800)
    refined = seg.predict(handle, [[200, 240]], [1], box=[80, 120, 330, 370],
                          mask_input=first.low_res_logits[0], multimask=False)
    plain = seg.predict(handle, [[200, 240]], [1], box=[80, 120, 330, 370], multimask=False)
    assert not np.allclose(refined.low_res_logits, plain.low_res_logits)  # the previous mask was used


def test_cache_is_bounded_and_evicted_images_still_work(checkpoint):
    seg = SegmentPipeline(TorchSamEngine(load_sam(checkpoint)), cache_bytes=1)  # room for one embedding only
    stats = SegmentStats()
    images = [np.full((64, 96, 3), v, dtype=np.uint8) for v in (10, 120, 240)]
    handles = [seg.set_image(img, stats) for img in images]
    assert len(seg._cache) == 1 and stats.encoder_runs == 3
    assert seg.predict(handles[0], [[5, 5]], [1], stats=stats).masks.shape == (3, 64, 96)  # re-encoded on demand
    assert stats.encoder_runs == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "add a point"),
    (dict(points=[[900, 10]], labels=[1]), "outside the 800×600 image"),
    (dict(points=[[-1, 10]], labels=[1]), "outside"),
    (dict(points=[[10, 10]], labels=[2]), "label"),
    (dict(points=[[10, 10]], labels=[]), "labels"),
    (dict(box=[300, 10, 100, 50]), "x0 < x1"),
    (dict(box=[0, 0, 801, 50]), "inside"),
])
def test_bad_prompts_are_explained(seg, photo, kwargs, message):
    with pytest.raises(UserError, match=message):
        seg.predict(seg.set_image(photo), **kwargs)


def test_overlay_and_png(seg, photo):
    result = seg.predict(seg.set_image(photo), [[100, 200]], [1])
    mask = np.zeros(photo.shape[:2], dtype=bool)
    mask[300:420, 250:520] = True  # a known region: the demo SAM's masks depend on its random weights
    overlay = render_overlay(photo, mask, [[100, 200], [700, 500]], [1, 0], box=[10, 10, 50, 50])
    assert overlay.shape == photo.shape and overlay.dtype == np.uint8
    assert overlay[200, 100].tolist() == [0, 200, 70] and overlay[500, 700].tolist() == [230, 40, 40]  # the points
    assert overlay[10, 30].tolist() == [255, 200, 0] and overlay[30, 10].tolist() == [255, 200, 0]  # the box
    inside, outside = mask.copy(), ~mask
    for y, x in ((200, 100), (500, 700)):
        inside[y - 12:y + 13, x - 12:x + 13] = outside[y - 12:y + 13, x - 12:x + 13] = False
    inside[:60, :60] = outside[:60, :60] = False
    assert np.array_equal(overlay[outside], photo[outside])  # untouched away from mask and marks
    tinted = (photo[inside] * 0.45 + np.array([30, 144, 255]) * 0.55).astype(np.uint8)
    assert np.abs(overlay[inside].astype(int) - tinted).max() <= 1
    png = Image.open(io.BytesIO(mask_png(result.masks[0])))
    assert png.size == (800, 600) and set(np.unique(np.asarray(png))) <= {0, 255}


def test_masks_shrink_as_pil_does_and_candidates_are_drawn_where_the_masks_are(seg, photo):
    """`shrink` (numpy or tensors, one mask or a batch) picks PIL's nearest pixels; the candidate
    thumbnails are drawn from the masks where they are, each with its own mask."""
    rng = np.random.default_rng(0)
    for (h, w), (sh, sw) in (((3024, 4032), (1200, 1600)), ((101, 77), (50, 33))):
        mask, like = rng.random((h, w)) > 0.5, np.zeros((sh, sw, 3), np.uint8)
        expected = np.asarray(Image.fromarray(mask).resize((sw, sh), Image.NEAREST))
        assert np.array_equal(shrink(mask, like), expected)
        batch = shrink(torch.from_numpy(np.stack([mask, ~mask])), like)
        assert isinstance(batch, torch.Tensor) and np.array_equal(batch[1].numpy(), ~expected)
    session = SegmentSession(seg, photo, (300, 400))
    session.click(400, 300)
    small = thumbnail(photo)
    drawn = render_candidates(session, small)
    assert len(drawn) == 3 and sum(caption.startswith("✓") for _, caption in drawn) == 1
    for (image, _), m in zip(drawn, session.prediction.masks):
        assert np.array_equal(image, render_overlay(small, shrink(m, small)))


@pytest.mark.parametrize("mode", ["L", "LA", "P", "RGBA", "I;16", "I", "F", "CMYK", "1"])
def test_every_image_mode_becomes_rgb(mode):
    base = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8))
    img = base.convert(mode) if mode not in ("I;16", "I", "F") else Image.fromarray(
        (np.arange(2000).reshape(40, 50) * 30).astype({"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]))
    data = png_bytes(img) if mode not in ("CMYK", "F", "I") else _tiff(img)
    arr = load_image(data)
    assert arr.shape == (40, 50, 3) and arr.dtype == np.uint8
    if mode == "I;16":
        assert arr.max() > 200  # 16-bit range stretched, not clipped to black


def _tiff(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="TIFF")
    return buf.getvalue()


def test_bad_images_are_explained(tmp_path):
    with pytest.raises(UserError, match="not an image"):
        load_image(b"definitely not a picture")
    with pytest.raises(UserError, match="only 1×1"):
        load_image(png_bytes(Image.new("RGB", (1, 1))))
    huge = tmp_path / "huge.png"
    Image.new("1", (20000, 20000)).save(huge)  # small file, 400 MP
    with pytest.raises(UserError, match="too large"):
        load_image(huge)
    big = tmp_path / "big.png"
    Image.new("1", (9000, 9000)).save(big)  # 81 MP: past our limit, below Pillow's bomb guard
    with pytest.raises(UserError, match="9000×9000"):
        load_image(big)
    truncated = png_bytes(Image.fromarray(np.random.default_rng(1).integers(0, 255, (300, 300, 3), dtype=np.uint8)))
    with pytest.raises(UserError):
        load_image(truncated[: len(truncated) // 2])
    with pytest.raises(UserError, match="does not exist"):
        load_image(tmp_path / "missing.png")


def test_display_copy_is_bounded():
    image = np.zeros((3000, 4000, 3), dtype=np.uint8)
    shown, scale = fit_for_display(image, 1600)
    assert shown.shape == (1200, 1600, 3) and scale == 0.4


class NotATensor:
    pass


def test_checkpoints_load_tensors_only(tmp_path):
    torch.save({"image_encoder.blocks.0.attn.qkv.weight": NotATensor()}, tmp_path / "evil.pth")
    with pytest.raises(UserError, match="cannot read SAM checkpoint"):  # weights_only refuses the object
        load_sam(tmp_path / "evil.pth")
    torch.save({"some.weight": torch.zeros(2)}, tmp_path / "other.pth")
    with pytest.raises(UserError, match="not a SAM checkpoint"):
        load_sam(tmp_path / "other.pth")
    with pytest.raises(UserError, match="does not exist"):
        load_sam(tmp_path / "missing.pth")


def test_sam_names_resolve(tmp_path, checkpoint):
    from pipeline.sam.weights import locate_sam

    assert locate_sam("sam_vit_h", tmp_path) == (tmp_path / "sam" / "sam_vit_h_4b8939.pth", "download")
    assert locate_sam(str(checkpoint), tmp_path) == (checkpoint, "local file")
    with pytest.raises(UserError, match="unknown SAM model"):
        locate_sam("sam_vit_x", tmp_path)


def test_box_nms_and_mask_boxes():
    from pipeline.pipelines.segment import box_nms, mask_boxes

    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30], [0, 0, 10, 9]])
    keep = box_nms(boxes, torch.tensor([0.5, 0.9, 0.8, 0.7]), threshold=0.7)
    assert keep.tolist() == [1, 2]  # the best of the three overlapping boxes, and the separate one
    masks = torch.zeros(2, 8, 12, dtype=torch.bool)
    masks[0, 2:5, 3:9] = True
    assert mask_boxes(masks).tolist() == [[3, 2, 9, 5], [0, 0, 0, 0]]


def test_segment_everything_mechanics(seg, photo):
    handle = seg.set_image(photo)
    stats = SegmentStats()
    loose = seg.segment_everything(handle, points_per_side=8, min_score=-1e9, min_stability=-1.0, nms_iou=1.0,
                                   stats=stats)
    assert loose and all(m.mask.shape == (600, 800) and m.mask.any() for m in loose)
    strict = seg.segment_everything(handle, points_per_side=8, min_score=-1e9, min_stability=-1.0, nms_iou=0.5,
                                    stats=stats)
    assert len(strict) <= len(loose)  # NMS only removes
    assert stats.encoder_runs == 0 and stats.cache_hits == 2  # the cached embedding serves the whole grid
    assert render_everything(photo, strict).shape == photo.shape
    small, _ = fit_for_display(photo, 400)
    assert render_everything(small, strict).shape == small.shape  # full-size masks drawn on the display copy


def test_content_key_and_resize_for_big_photos():
    """The cache key sees every pixel (hashed in parallel chunks); the resize SAM and the display use
    stays within one level of PIL's bilinear resize."""
    from pipeline.images import HASH_CHUNK, content_key, fit_for_display, resize_image

    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, (1500, 2000, 3), dtype=np.uint8)
    assert big.nbytes > 2 * HASH_CHUNK
    changed = big.copy()
    changed[-1, -1, -1] ^= 1  # one bit in the last chunk
    assert content_key(big) == content_key(big.copy()) != content_key(changed)
    assert content_key(big) != content_key(big.reshape(2000, 1500, 3))  # same bytes, other shape
    smooth = np.asarray(Image.fromarray(big).resize((200, 150)).resize((2000, 1500), Image.BICUBIC))
    ours = resize_image(torch.from_numpy(smooth.copy()), (375, 500)).permute(1, 2, 0).numpy()
    pil, _ = fit_for_display(smooth, max_side=500)
    assert pil.shape == ours.shape and np.abs(pil.astype(np.float32) - ours).max() <= 1


def test_masked_crop_keeps_the_object_and_dims_its_surroundings():
    from pipeline.images import masked_crop

    image = np.full((100, 200, 3), 200, dtype=np.uint8)
    mask = np.zeros((100, 200), dtype=bool)
    mask[40:60, 100:140] = True  # a 20 × 40 object
    crop = masked_crop(image, mask, margin=0.25, dim=0.5)
    assert crop.shape == (30, 60, 3)  # the object plus a quarter of its size on each side
    assert (crop[5:25, 10:50] == 200).all()  # the object untouched
    assert (crop[0, 0] == 100).all()  # the surroundings at half brightness
    with pytest.raises(UserError, match="empty"):
        masked_crop(image, np.zeros_like(mask))
    with pytest.raises(UserError, match="same size"):
        masked_crop(image, mask[:50])


@pytest.mark.parametrize("size, to", [((601, 899), (687, 1024)), ((3001, 4003), (768, 1024)), ((41, 29), (97, 70)),
                                      ((1024, 333), (1024, 333)), ((500, 700), (500, 1024))])
def test_sams_resize_off_the_cpu_is_pillows_bilinear_bit_for_bit(size, to):
    """On a GPU the photo SAM encodes is resized there, by Pillow's own fixed-point passes (checked here on CPU
    tensors): equal to Pillow's bilinear resize, which SAM's reference preprocessing uses, at every pixel."""
    from pipeline.images import pil_bilinear_passes

    image = np.random.default_rng(sum(size)).integers(0, 256, (*size, 3), dtype=np.uint8)
    pil = np.array(Image.fromarray(image).resize(to[::-1], Image.BILINEAR)).transpose(2, 0, 1)
    assert np.array_equal(pil_bilinear_passes(torch.from_numpy(image), to).numpy(), pil)
