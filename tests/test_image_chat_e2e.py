"""The Image-chat tool end to end: `launch.py` in a subprocess, driven through `gradio_client`."""

import pytest
from PIL import Image

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import handle_file  # noqa: E402

from test_app_e2e import text_of  # noqa: E402

PHOTO = "assets/examples/fruit_bowl.jpg"
SAMPLING = (0.7, 0.9, 40, 1.05, 24, 5)  # temperature, top-p, top-k, repetition penalty, max new tokens, seed


@pytest.fixture(scope="module")
def client(running_app):
    url = running_app.url
    return gradio_client.Client(url, verbose=False)


def ask(client, image, question, history):
    job = client.submit(handle_file(image) if image else None, question, history, *SAMPLING, api_name="/image_chat")
    updates = list(job)
    job.result()  # raises the app's error, if any
    return updates


def test_two_questions_two_streamed_answers(client):
    updates = ask(client, PHOTO, "What is unusual here?", [])
    history, status = updates[-1]
    # streamed: partial updates before the last (paced at 50 ms, so a fast reply has few of them)
    replying = [u for u in updates if len(u[0]) == len(history)]  # (the first ones may say the tool is loading)
    assert len(replying) >= 2 and len(text_of(replying[0][0][-1])) < len(text_of(history[-1]))
    assert [m["role"] for m in history] == ["user", "assistant"] and text_of(history[1])
    assert "tok/s" in status
    updates = ask(client, PHOTO, "And what colour is the bowl?", history)
    history2, _ = updates[-1]
    replying = [u for u in updates if len(u[0]) == len(history2)]
    assert len(replying) >= 2 and len(text_of(replying[0][0][-1])) < len(text_of(history2[-1]))
    assert [m["role"] for m in history2] == ["user", "assistant", "user", "assistant"]
    assert text_of(history2[1]) == text_of(history[1]) and text_of(history2[3])


def test_bad_inputs_get_clear_messages_and_the_app_keeps_serving(client, tmp_path):
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    tiny = tmp_path / "tiny.png"
    Image.new("RGB", (2, 2)).save(tiny)
    huge = tmp_path / "huge.png"
    Image.new("1", (20000, 20000)).save(huge)
    cases = [(None, "hi", "upload an image"), (str(corrupt), "hi", "not an image"), (str(tiny), "hi", "only 2×2"),
             (str(huge), "hi", "too large"), (PHOTO, "   ", "empty")]
    for image, question, expected in cases:
        with pytest.raises(Exception) as err:
            ask(client, image, question, [])
        assert expected in str(err.value), (expected, str(err.value))
    updates = ask(client, PHOTO, "Describe every detail " * 700, [])  # over-long: cut, with a notice
    assert "cut" in updates[-1][1]
    assert text_of(ask(client, PHOTO, "Still there?", [])[-1][0][0]) == "Still there?"
