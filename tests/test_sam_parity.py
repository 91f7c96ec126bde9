"""Our SAM against the official segment_anything code on the same random weights (fp32)."""

from functools import partial

import pytest
import torch

from official_sam import official_sam_modules
from pipeline.sam.model import PIXEL_MEAN, PIXEL_STD, VARIANTS, Sam, load_sam
from pipeline.sam.transforms import upscale_masks
from sam_prompts import PROMPTS, prompt_tensors

DEMO = VARIANTS["demo"]


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def official_sam(config):
    m = official_sam_modules()
    grid = config.img_size // config.patch_size
    return m.Sam(
        image_encoder=m.ImageEncoderViT(
            depth=config.encoder_depth, embed_dim=config.encoder_embed_dim, img_size=config.img_size, mlp_ratio=4,
            norm_layer=partial(torch.nn.LayerNorm, eps=1e-6), num_heads=config.encoder_num_heads,
            patch_size=config.patch_size, qkv_bias=True, use_rel_pos=True,
            global_attn_indexes=config.encoder_global_attn_indexes, window_size=config.window_size,
            out_chans=config.prompt_embed_dim),
        prompt_encoder=m.PromptEncoder(embed_dim=config.prompt_embed_dim, image_embedding_size=(grid, grid),
                                       input_image_size=(config.img_size, config.img_size), mask_in_chans=16),
        mask_decoder=m.MaskDecoder(
            num_multimask_outputs=3, transformer_dim=config.prompt_embed_dim, iou_head_depth=3,
            iou_head_hidden_dim=config.prompt_embed_dim,
            transformer=m.TwoWayTransformer(depth=config.decoder_depth, embedding_dim=config.prompt_embed_dim,
                                            mlp_dim=config.decoder_mlp_dim, num_heads=config.decoder_num_heads)),
        pixel_mean=list(PIXEL_MEAN), pixel_std=list(PIXEL_STD)).eval()


@pytest.mark.parametrize("name", ["vit_b", "vit_l", "vit_h"])
def test_real_variants_have_the_official_layout(name):
    build = getattr(official_sam_modules(), "Sam")  # noqa: F841  (imports the official code)
    from segment_anything import build_sam

    with torch.device("meta"):
        official = getattr(build_sam, f"build_sam_{name}")()
        ours = Sam(VARIANTS[name])
    theirs = {k: tuple(v.shape) for k, v in official.state_dict().items()}
    assert theirs == {k: tuple(v.shape) for k, v in ours.state_dict().items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    official = official_sam(DEMO)
    with torch.no_grad():
        for name, p in official.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
        official.mask_decoder.iou_prediction_head.layers[-1].weight.normal_(0, 2.0)  # scores of order 1
    path = tmp_path_factory.mktemp("sam") / "sam_demo.pth"
    torch.save(official.state_dict(), path)  # exactly the official layout
    return official, load_sam(path), path


@pytest.fixture(scope="module")
def embeddings(models):
    official, ours, _ = models
    x = torch.randn(1, 3, 1024, 1024, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return official.image_encoder(x), ours.image_encoder(x)


def test_image_embeddings_match(embeddings):
    theirs, mine = embeddings
    assert mine.shape == theirs.shape == (1, DEMO.prompt_embed_dim, 64, 64)
    assert rel_err(mine, theirs) <= 1e-4


def run_both(models, embeddings, prompt, mask_input=None, multimask=True):
    official, ours, _ = models
    theirs_emb, mine_emb = embeddings
    points, box = prompt_tensors(prompt)
    with torch.inference_mode():
        sparse, dense = official.prompt_encoder(points=points, boxes=box, masks=mask_input)
        theirs = official.mask_decoder(image_embeddings=theirs_emb, image_pe=official.prompt_encoder.get_dense_pe(),
                                       sparse_prompt_embeddings=sparse, dense_prompt_embeddings=dense,
                                       multimask_output=multimask)
        mine = ours.decode(mine_emb, points, box, mask_input, multimask)
    return theirs, mine


def mask_iou(a, b) -> float:
    union = (a | b).sum()
    return 1.0 if union == 0 else ((a & b).sum() / union).item()  # two empty masks agree


@pytest.mark.parametrize("multimask", [True, False])
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_masks_and_scores_match(models, embeddings, name, multimask):
    (low_t, iou_t), (low_m, iou_m) = run_both(models, embeddings, PROMPTS[name], multimask=multimask)
    assert low_m.shape == low_t.shape == (1, 3 if multimask else 1, 256, 256)
    assert rel_err(low_m, low_t) <= 1e-4 and rel_err(iou_m, iou_t) <= 1e-4
    official, ours, _ = models
    big_t = official.postprocess_masks(low_t, (1024, 768), (1200, 900)) > 0
    big_m = upscale_masks(low_m, DEMO.img_size, (1024, 768), (1200, 900)) > 0
    assert big_m.shape == (1, low_m.shape[1], 1200, 900)
    assert mask_iou(big_m, big_t) >= 0.99
    if multimask:
        assert big_t.any()  # random weights still give some foreground among the three candidates


def test_refinement_with_previous_mask(models, embeddings):
    (low_t, _), _ = run_both(models, embeddings, PROMPTS["point"])
    previous = low_t[:, :1]  # the low-res logits a click returned, fed back with the next click
    (low_t2, iou_t2), (low_m2, iou_m2) = run_both(models, embeddings, PROMPTS["multi_point"], mask_input=previous)
    assert rel_err(low_m2, low_t2) <= 1e-4 and rel_err(iou_m2, iou_t2) <= 1e-4
    assert rel_err(low_t2, run_both(models, embeddings, PROMPTS["multi_point"])[0][0]) > 1e-3  # the mask mattered
