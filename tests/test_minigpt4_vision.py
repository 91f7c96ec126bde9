"""MiniGPT-4's vision side against transformers' Blip2VisionModel + Blip2QFormerModel (fp32)."""

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from pipeline.minigpt4.vision import TINY, MiniGPT4Vision  # noqa: E402
from pipeline.minigpt4.weights import build_demo, hf_to_original, load_vision, read_hf_blip2  # noqa: E402


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def hf_blip2(tmp_path_factory):
    torch.manual_seed(0)
    vision = transformers.Blip2VisionModel(transformers.Blip2VisionConfig(
        hidden_size=TINY.vit_width, intermediate_size=TINY.vit_mlp, num_hidden_layers=3,
        num_attention_heads=TINY.vit_heads, image_size=224, patch_size=14, qkv_bias=True)).eval()
    qformer = transformers.Blip2QFormerModel(transformers.Blip2QFormerConfig(
        hidden_size=TINY.qformer_width, num_hidden_layers=4, num_attention_heads=TINY.qformer_heads,
        intermediate_size=TINY.qformer_mlp, encoder_hidden_size=TINY.vit_width, cross_attention_frequency=2)).eval()
    with torch.no_grad():
        for name, p in [*vision.named_parameters(), *qformer.named_parameters()]:
            p.uniform_(0.5, 1.5) if "norm" in name.lower() and name.endswith("weight") else p.normal_(0, 0.1)
    query_tokens = torch.randn(1, 32, TINY.qformer_width)
    state = {"query_tokens": query_tokens, "language_model.lm_head.weight": torch.zeros(8, 4)}
    state |= {f"vision_model.{k}": v for k, v in vision.state_dict().items()}
    state |= {f"qformer.{k}": v for k, v in qformer.state_dict().items()}
    folder = tmp_path_factory.mktemp("blip2")
    half = len(state) // 2
    items = list(state.items())
    save_file({k: v.contiguous() for k, v in items[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: v.contiguous() for k, v in items[half:]}, str(folder / "model-00002-of-00002.safetensors"))
    proj = torch.nn.Linear(TINY.qformer_width, 64)
    torch.save({"model": {"llama_proj.weight": proj.weight.data, "llama_proj.bias": proj.bias.data}},
               folder / "prerained_minigpt4_7b.pth")
    return vision, qformer, query_tokens, proj, folder


def test_only_vision_tensors_are_read(hf_blip2):
    *_, folder = hf_blip2
    keys = read_hf_blip2(folder).keys()
    assert "query_tokens" in keys and not any(k.startswith("language_model") for k in keys)


def test_key_mapping_covers_every_original_tensor(hf_blip2):
    *_, folder = hf_blip2
    mapped = hf_to_original(read_hf_blip2(folder))
    model = MiniGPT4Vision(load_vision(folder / "prerained_minigpt4_7b.pth", hf_blip2=folder).config)
    assert set(mapped) == set(model.state_dict()) - {"llama_proj.weight", "llama_proj.bias"}
    assert "visual_encoder.blocks.0.attn.q_bias" in mapped and "Qformer.bert.encoder.layer.0.attention.self.query.weight" in mapped


def test_vision_and_qformer_match_transformers(hf_blip2):
    vision, qformer, query_tokens, proj, folder = hf_blip2
    ours = load_vision(folder / "prerained_minigpt4_7b.pth", hf_blip2=folder)
    assert ours.config.vit_depth == 3 and ours.config.qformer_depth == 4 and ours.config.cross_attention_freq == 2
    pixels = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        image = vision(pixel_values=pixels).last_hidden_state  # includes post_layernorm = ln_vision
        ref = qformer(query_embeds=query_tokens.expand(2, -1, -1), encoder_hidden_states=image).last_hidden_state
        assert rel_err(ours.ln_vision(ours.visual_encoder(pixels)), image) <= 1e-4
        assert rel_err(ours.image_features(pixels), ref) <= 1e-4
        assert rel_err(ours(pixels), proj(ref)) <= 1e-4


def test_original_files_load(tmp_path):
    build_demo(tmp_path, llm_width=64)
    a = load_vision(tmp_path / "prerained_minigpt4_7b.pth", eva=tmp_path / "eva_vit_g.pth",
                    blip2=tmp_path / "blip2_pretrained_flant5xxl.pth")
    assert a.config == TINY
    raw = torch.load(tmp_path / "eva_vit_g.pth", weights_only=True)
    assert "blocks.0.attn.q_bias" in raw and "cls_token" in raw  # EVA's own names, no prefix
    assert torch.equal(a.visual_encoder.blocks[0].attn.q_bias, raw["blocks.0.attn.q_bias"])
