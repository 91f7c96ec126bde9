"""Our MobileSAM (TinyViT encoder + SAM's decoder) against the official MobileSAM code, on the same random
weights at the real shapes, saved as the official `mobile_sam.pt` is (a plain state dict of its `Sam`), fp32
on the CPU: image embeddings, then masks, IoU scores and low-res logits for clicks and boxes."""

import numpy as np
import pytest
import torch
from torch import nn

from official_mobile_sam import official_mobile_sam
from pipeline.errors import UserError
from pipeline.sam.engine import TorchSamEngine
from pipeline.sam.model import VARIANTS, Sam, load_sam
from pipeline.sam.tiny_vit import CHECKPOINT_KEYS_NOT_USED
from pipeline.sam.transforms import preprocess, upscale_masks
from sam_prompts import PROMPTS, prompt_tensors

OFFICIAL = official_mobile_sam()  # skips this module where mobilesam-mirror is not installed
MOBILE_SAM = VARIANTS["mobile_sam"]
RESIZED, ORIGINAL = (768, 1024), (900, 1200)  # a 4:3 photo: the padded bottom rows are part of the input
UNUSED = {"image_encoder.norm_head.weight", "image_encoder.norm_head.bias", "image_encoder.head.weight",
          "image_encoder.head.bias"}  # TinyViT's ImageNet classifier, in the official state dict


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def max_err(a, b) -> float:
    """The largest difference relative to the output's scale (its largest magnitude)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def spread_(model: nn.Module) -> None:
    """Random weights whose every part matters: PyTorch's default init for TinyViT's linear layers (its own
    std 0.02 makes q·k vanish), BatchNorm running statistics and affine terms away from 0 and 1 (MBConv's
    last BatchNorm starts at weight 0), LayerNorms perturbed, attention biases of order one."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and name.startswith("image_encoder."):
                m.reset_parameters()
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5), m.bias.normal_(0, 0.2)
                m.running_mean.normal_(0, 0.2), m.running_var.uniform_(0.5, 2.0)
            elif isinstance(m, nn.LayerNorm) or type(m).__name__ == "LayerNorm2d":
                m.weight.uniform_(0.5, 1.5), m.bias.normal_(0, 0.2)
            if hasattr(m, "attention_biases"):
                m.attention_biases.normal_(0, 1.0)
    model.eval()  # the official attention caches its biases (`ab`) on eval(): refresh it


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    official = OFFICIAL.build_sam_vit_t()
    spread_(official)
    path = tmp_path_factory.mktemp("mobile_sam") / "mobile_sam.pt"
    torch.save(official.state_dict(), path)  # exactly the official layout
    return official, path


@pytest.fixture(scope="module")
def models(checkpoint):
    official, path = checkpoint
    return official, load_sam(path)


def test_the_official_layout_loads_but_for_the_listed_keys(checkpoint):
    official, _ = checkpoint
    theirs = {k: tuple(v.shape) for k, v in official.state_dict().items()}
    with torch.device("meta"):
        ours = {k: tuple(v.shape) for k, v in Sam(MOBILE_SAM).state_dict().items()}
    assert set(theirs) - set(ours) == UNUSED and set(ours) <= set(theirs)
    assert all(ours[k] == theirs[k] for k in ours)
    assert {"norm_head.weight", "norm_head.bias", "head.weight", "head.bias"} <= set(CHECKPOINT_KEYS_NOT_USED)


def test_unknown_keys_are_an_error_and_a_stored_bias_index_is_checked(checkpoint, tmp_path):
    official, _ = checkpoint
    state = official.state_dict()
    torch.save({**state, "image_encoder.layers.1.blocks.0.attn.extra": torch.zeros(1)}, tmp_path / "extra.pt")
    with pytest.raises(RuntimeError, match="Unexpected key"):
        load_sam(tmp_path / "extra.pt")
    key = "image_encoder.layers.2.blocks.3.attn.attention_bias_idxs"
    index = official.image_encoder.layers[2].blocks[3].attn.attention_bias_idxs
    torch.save({**state, key: index}, tmp_path / "with_index.pt")  # as code with a persistent buffer saves it
    load_sam(tmp_path / "with_index.pt")
    torch.save({**state, key: index.flip(0)}, tmp_path / "other_index.pt")
    with pytest.raises(UserError, match="attention biases differently"):
        load_sam(tmp_path / "other_index.pt")


@pytest.fixture(scope="module")
def embeddings(models):
    """One encode each of the same 1024×1024 input: our preprocessing (and engine) vs the official model's."""
    official, ours = models
    image = torch.randint(0, 256, (3, *RESIZED), generator=torch.Generator().manual_seed(1)).float()
    with torch.inference_mode():
        theirs = official.image_encoder(official.preprocess(image[None]))
    return theirs, TorchSamEngine(ours).encode(preprocess(image, MOBILE_SAM.img_size))


def test_image_embeddings_match(embeddings):
    theirs, mine = embeddings
    assert mine.shape == theirs.shape == (1, 256, 64, 64)
    assert max_err(mine, theirs) <= 1e-4 and rel_err(mine, theirs) <= 1e-5


def mask_iou(a, b) -> float:
    union = (a | b).sum()
    return 1.0 if union == 0 else ((a & b).sum() / union).item()


@pytest.mark.parametrize("multimask", [True, False])
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_masks_and_scores_match(models, embeddings, name, multimask):
    """The official side is called as its `SamPredictor.predict_torch` calls it."""
    official, ours = models
    theirs_emb, mine_emb = embeddings
    points, box = prompt_tensors(PROMPTS[name])
    with torch.inference_mode():
        sparse, dense = official.prompt_encoder(points=points, boxes=box, masks=None)
        low_t, iou_t = official.mask_decoder(
            image_embeddings=theirs_emb, image_pe=official.prompt_encoder.get_dense_pe(),
            sparse_prompt_embeddings=sparse, dense_prompt_embeddings=dense, multimask_output=multimask)
        masks_t = official.postprocess_masks(low_t, RESIZED, ORIGINAL)
        low_m, iou_m = TorchSamEngine(ours).decode(mine_emb, points, box, None, multimask)
        masks_m = upscale_masks(low_m, MOBILE_SAM.img_size, RESIZED, ORIGINAL)
    assert low_m.shape == low_t.shape == (1, 3 if multimask else 1, 256, 256)
    assert masks_m.shape == masks_t.shape == (1, low_m.shape[1], *ORIGINAL)
    assert max_err(low_m, low_t) <= 1e-4 and max_err(masks_m, masks_t) <= 1e-4
    assert max_err(iou_m, iou_t) <= 1e-4
    assert mask_iou(masks_m > 0, masks_t > 0) >= 0.999
    if multimask:
        assert (masks_t > 0).any() and not (masks_t > 0).all()  # random weights still give a real mask


def photo(h: int, w: int) -> np.ndarray:
    """A smooth picture with edges (gradients, a disc, a bar) and some grain: resizing rounds differently
    across it, as on a real photo."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    image = np.stack([x / w * 200, y / h * 180, (x + y) / (h + w) * 220], axis=-1)
    image[(x - 0.6 * w) ** 2 + (y - 0.4 * h) ** 2 < (0.2 * min(h, w)) ** 2] = (230, 40, 40)
    image[int(0.7 * h):int(0.8 * h), int(0.1 * w):int(0.5 * w)] = (20, 60, 200)
    image += np.random.default_rng(3).normal(0, 6, image.shape)
    return image.clip(0, 255).astype(np.uint8)


def test_every_candidate_of_an_odd_sized_photo_is_the_official_codes(models):
    """The whole path from an odd-sized photo: the official side resized as its `ResizeLongestSide` does
    (torchvision's resize of a PIL image: Pillow's bilinear), encoded, prompted and upscaled as
    `SamPredictor` does; ours through `SegmentPipeline`. The embedding and each of the three candidates match,
    not only the best one."""
    from PIL import Image

    from pipeline.pipelines.segment import SegmentPipeline, SegmentStats

    official, ours = models
    image, points, labels = photo(601, 899), [[640.0, 250.0], [150.0, 450.0]], [1, 0]
    h, w = image.shape[:2]
    newh, neww = int(h * 1024 / max(h, w) + 0.5), int(w * 1024 / max(h, w) + 0.5)
    resized = np.array(Image.fromarray(image).resize((neww, newh), Image.BILINEAR))
    with torch.inference_mode():
        their_input = official.preprocess(torch.as_tensor(resized).permute(2, 0, 1)[None].float())
        theirs_emb = official.image_encoder(their_input)
        coords = torch.tensor([points]) * torch.tensor([neww / w, newh / h])
        sparse, dense = official.prompt_encoder(points=(coords, torch.tensor([labels])), boxes=None, masks=None)
        low_t, iou_t = official.mask_decoder(
            image_embeddings=theirs_emb, image_pe=official.prompt_encoder.get_dense_pe(),
            sparse_prompt_embeddings=sparse, dense_prompt_embeddings=dense, multimask_output=True)
        masks_t = official.postprocess_masks(low_t, (newh, neww), (h, w))[0] > 0
    engine, encoded = TorchSamEngine(ours), []
    encode = engine.encode
    engine.encode = lambda pixels: encoded.append(pixels) or encode(pixels)  # records what the encoder is given
    pipeline = SegmentPipeline(engine)
    handle = pipeline.set_image(image)
    # the encoder's input is the official one, bit for bit (a resize within one level of Pillow's, as before,
    # changed 18 % of the pixels); random weights barely tell such inputs apart, real ones flip candidates
    assert len(encoded) == 1 and torch.equal(encoded[0], their_input)
    assert max_err(pipeline._embedding(handle, SegmentStats()), theirs_emb) <= 1e-4
    got = pipeline.predict(handle, points, labels)
    assert np.abs(got.scores - iou_t[0].numpy()).max() <= 1e-3
    ious = [mask_iou(torch.as_tensor(np.asarray(got.masks[i])), masks_t[i]) for i in range(3)]
    assert all(m.any() and not m.all() for m in masks_t)
    assert min(ious) >= 0.999, ious
