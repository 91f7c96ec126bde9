"""A bounded load test on loopback: 20 sessions × 5 turns mixing chat, image chat, segmentation and the
OpenAI API at once. Nothing fails, and every reply lands in its own session."""

import base64
import json
import threading

import openai
from gradio_client import Client, handle_file

from conftest import ROOT

SESSIONS, TURNS = 20, 5
IMAGE = ROOT / "assets/examples/shapes.jpg"


def session(url: str, index: int, errors: list, histories: dict) -> None:
    client = Client(url, verbose=False)
    api = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=300)
    chat_history: list = []
    image_history: list = []
    try:
        for turn in range(TURNS):
            marker = f"session {index} turn {turn}"
            kind = (index + turn) % 4
            if kind == 0:
                _, chat_history, status = client.predict(marker, chat_history, "Be brief.", 0.7, 0.8, 20, 1.05, 6,
                                                         index, api_name="/chat")
                assert "tok/s" in status
            elif kind == 1:
                image_history, status = client.predict(handle_file(str(IMAGE)), marker, image_history, 0.7, 0.8, 20,
                                                       1.05, 6, index, api_name="/image_chat")
                assert "tok/s" in status
            elif kind == 2:
                mask, info = client.predict(handle_file(str(IMAGE)), json.dumps([[100 + index, 80 + turn, 1]]), "",
                                            True, api_name="/segment")
                assert len(json.loads(info)["scores"]) == 3
            else:
                url_data = "data:image/jpeg;base64," + base64.b64encode(IMAGE.read_bytes()).decode()
                content = [{"type": "text", "text": marker}] + ([{"type": "image_url", "image_url": {"url": url_data}}]
                                                                if turn % 2 else [])
                answer = api.chat.completions.create(model="demo/qwen-v1-tiny", max_tokens=6,
                                                     messages=[{"role": "user", "content": content}])
                assert answer.usage.completion_tokens >= 1
        histories[index] = (chat_history, image_history)
    except Exception as e:  # noqa: BLE001 - collected and reported by the test
        errors.append(f"session {index}: {type(e).__name__}: {e}")


def test_twenty_sessions_mixing_every_tool_at_once(running_app):
    url = running_app[0]
    errors: list = []
    histories: dict = {}
    threads = [threading.Thread(target=session, args=(url, i, errors, histories)) for i in range(SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors[:5]
    assert len(histories) == SESSIONS
    for index, (chat_history, image_history) in histories.items():
        for history in (chat_history, image_history):
            users = [m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
                     for m in history if m["role"] == "user"]
            assert all(u.startswith(f"session {index} turn ") for u in users), (index, users)  # its own turns only
            assert len(history) == 2 * len(users)
