"""Issue 42 in a real browser: Image chat's first use downloads SmolVLM (from a slow local hub,
tests/hub_server.py); its status says how to stop that, the Models tab's Cancel download does (no download of
the user's own is running there), Image chat says so in a toast, and its next use downloads again. Ctrl+C
meanwhile shuts the app down at once (huggingface_hub's download threads would keep it alive)."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")

from test_browser import browser, browser_page  # noqa: E402,F401 - the module's Chromium, a page on the app
from test_smolvlm import folder  # noqa: E402,F401 - the tiny SmolVLM checkpoint fixture
from test_smolvlm_chat import TEMPLATE  # noqa: E402

from hub_server import serving  # noqa: E402

pytestmark = pytest.mark.browser
SMOLVLM = "HuggingFaceTB/SmolVLM-256M-Instruct"
HINT = "Cancel download in the Models tab stops it"


def test_models_tab_cancels_image_chats_first_use_download(browser, tmp_path, folder, monkeypatch):  # noqa: F811
    from conftest import launched

    repo = tmp_path / "smolvlm"
    shutil.copytree(folder, repo)
    (repo / "chat_template.jinja").write_text(TEMPLATE)
    (repo / "padding.txt").write_bytes(os.urandom(96 << 20))  # a download of half a minute or more
    with serving({SMOLVLM: repo}, delay_s=0.005) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        with launched(tmp_path / "launch.log", tmp_path / "cache", "--data-dir", str(tmp_path / "data")) as app, \
                browser_page(browser, app.url) as page:
            page.get_by_role("tab", name="Image chat").click()
            page.locator("#image-chat-image input[type=file]").set_input_files("assets/examples/shapes.jpg")
            question = page.get_by_placeholder("Ask about the image, Enter to send")
            question.fill("What is this?")
            question.press("Enter")
            status = page.locator("#image-chat-status")
            status.get_by_text("downloaded").wait_for()
            assert HINT in status.inner_text(), status.inner_text()

            page.get_by_role("tab", name="Models").click()
            page.get_by_role("button", name="Cancel download").click()
            page.get_by_text(f"the download of {SMOLVLM} was cancelled: use Image chat again").first.wait_for()
            page.locator("#models-status").get_by_text("Downloaded").wait_for(state="detached")  # none of its own

            page.get_by_role("tab", name="Image chat").click()
            page.locator("#image-chat-send").wait_for(state="visible")
            for _ in range(3):  # Gradio drops a submit that comes while the last event is still closing
                question.fill("What is this?")
                question.press("Enter")
                if _fetched(hub, "padding.txt", 2, within_s=10):  # its next use downloads again
                    break
            assert _fetched(hub, "padding.txt", 2, within_s=0), hub.ranges

            app.process.send_signal(signal.SIGINT)  # Ctrl+C while that download runs
            app.process.wait(timeout=60)
        log = app.log.read_text()
        assert "Traceback" not in log, log[-3000:]
        assert "shutting down" in log and "still shutting down" not in log, log[-3000:]  # not held 20 s
        gets = [name for name, _ in hub.ranges]
    assert gets.count("padding.txt") == 2 and gets.count("config.json") == 1, gets  # complete files kept


def _fetched(hub, name: str, times: int, within_s: float) -> bool:
    """Whether the hub has been asked for `name` `times` times, waiting up to `within_s`."""
    deadline = time.monotonic() + within_s
    while [n for n, _ in hub.ranges].count(name) < times:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
