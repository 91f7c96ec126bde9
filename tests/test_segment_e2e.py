"""The Segment tool end to end: `launch.py` in a subprocess, driven through `gradio_client`."""

import json

import numpy as np
import pytest
from PIL import Image

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import handle_file  # noqa: E402

PHOTO = "assets/examples/street.jpg"  # 960×540


@pytest.fixture(scope="module")
def client(running_app):
    url = running_app.url
    return gradio_client.Client(url, verbose=False)


def segment(client, image, points="[]", box="", multimask=True):
    mask_path, info = client.predict(handle_file(str(image)), points, box, multimask, api_name="/segment")
    return Image.open(mask_path), json.loads(info)


def test_clicks_give_masks_of_the_image_size_and_reuse_the_embedding(client):
    mask, first = segment(client, PHOTO, "[[470, 350, 1]]")
    assert mask.size == (960, 540) and set(np.unique(np.asarray(mask))) <= {0, 255}
    assert len(first["scores"]) == 3
    assert not first["cached"] and first["encoder_ms"] > 0 and first["decoder_ms"] > 0  # this call encoded
    for points in ("[[470, 350, 1], [200, 200, 0]]", "[[100, 450, 1]]", "[[10, 10, 0], [950, 530, 1]]"):
        mask, info = segment(client, PHOTO, points)
        assert mask.size == (960, 540)
        assert info["cached"] and info["encoder_ms"] == 0  # the encoder ran once for this image
    mask, info = segment(client, PHOTO, box="[380, 300, 560, 400]", multimask=False)
    assert mask.size == (960, 540) and len(info["scores"]) == 1


def write(tmp_path, name, img: Image.Image) -> str:
    path = tmp_path / name
    img.save(path)
    return str(path)


@pytest.mark.parametrize("mode", ["L", "RGBA", "I;16", "P"])
def test_unusual_pngs_segment(client, tmp_path, mode):
    arr = np.random.default_rng(0).integers(0, 255, (120, 160, 3), dtype=np.uint8)
    img = Image.fromarray(arr).convert(mode) if mode != "I;16" else Image.fromarray(
        (np.arange(120 * 160).reshape(120, 160) * 3).astype(np.uint16))
    mask, _ = segment(client, write(tmp_path, f"img_{mode.replace(';', '')}.png", img), "[[80, 60, 1]]")
    assert mask.size == (160, 120)


def test_bad_inputs_get_clear_messages_and_the_app_keeps_serving(client, tmp_path):
    not_image = tmp_path / "notes.png"
    not_image.write_text("this is text, not a PNG")
    huge = tmp_path / "huge.png"
    Image.new("1", (20000, 20000)).save(huge)
    cases = [
        (str(not_image), "[[1, 1, 1]]", "", "not an image"),
        (write(tmp_path, "tiny.png", Image.new("RGB", (1, 1))), "[[0, 0, 1]]", "", "only 1×1"),
        (str(huge), "[[1, 1, 1]]", "", "too large"),
        (PHOTO, "[[5000, 10, 1]]", "", "outside the 960×540 image"),
        (PHOTO, "[]", "", "add a point"),
        (PHOTO, "[[1, 2]]", "", "points must be a list like"),
        (PHOTO, "not json", "", "not valid JSON"),
        (PHOTO, "[]", "[500, 10, 100, 50]", "x0 < x1"),
    ]
    for image, points, box, expected in cases:
        with pytest.raises(Exception) as err:
            segment(client, image, points, box)
        assert expected in str(err.value), (expected, str(err.value))
    mask, _ = segment(client, PHOTO, "[[470, 350, 1]]")
    assert mask.size == (960, 540)


def test_points_without_an_image_are_refused(client):
    with pytest.raises(Exception, match="send an image first"):
        client.predict(None, "[[1, 1, 1]]", "", True, api_name="/segment")
