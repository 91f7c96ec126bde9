"""Issue 42's must-show 2 in a real browser: the app started as users start it (`--sam auto`, `--vlm auto`,
an empty cache), with the Hugging Face hub a local one (tests/hub_server.py, through HF_ENDPOINT) serving a
random-weight MobileSAM in the official `mobile_sam.pt` layout and a tiny random SmolVLM under the default id.
One flow: Segment downloads MobileSAM, a click gives a mask, "Ask about this" sends the selected object to
Image chat, which downloads SmolVLM and streams its answer; a follow-up typed there streams too. The page says
the downloaded models run, never a demo's notice.

The waits are on conditions (with room for a slow CPU's downloads and loads), never on the clock."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")

from test_browser import browser, browser_page  # noqa: E402,F401 - the module's Chromium, a page on the app
from test_smolvlm import folder  # noqa: E402,F401 - the tiny SmolVLM checkpoint fixture
from test_smolvlm_chat import TEMPLATE  # noqa: E402

from hub_server import serving  # noqa: E402
from pipeline.sam.model import VARIANTS, Sam  # noqa: E402

pytestmark = pytest.mark.browser
MOBILE_SAM = "dhkim2810/MobileSAM"  # where `--sam auto` downloads MobileSAM from (pipeline/sam/weights.py)
SMOLVLM = "HuggingFaceTB/SmolVLM-256M-Instruct"  # what `--vlm auto` downloads on a CPU, or with no VLM cached
SLOW = 600_000  # ms: a download and a first load on a busy 2-core CPU (each takes seconds here)

# What the page would say if a tool fell back to its random-weight demo (app/ui.py, app/segment_render.py,
# studio/compose.py): none of it may show.
DEMO_TEXTS = ["Demo SAM.", "Demo MiniGPT-4.", "Demo SAM with random weights", "demo/sam-tiny", "MiniGPT-4 (",
              "The demo SAM (random weights) runs instead", "The MiniGPT-4 demo (random weights) runs instead"]


def _no_demo_notice(page) -> None:
    """None of DEMO_TEXTS in the page, shown or folded away (the start-up report's accordion)."""
    text = page.evaluate("document.body.textContent")
    assert not [t for t in DEMO_TEXTS if t in text], [line.strip() for line in text.splitlines()
                                                      if any(t in line for t in DEMO_TEXTS)]


# Every text the last answer of image chat and its status line show, in order (each change kept once):
# what the browser drew while the reply streamed.
WATCH = """() => {
  const seen = window.__seen = {bot: [], status: []};
  const note = (list, text) => { if (list[list.length - 1] !== text) list.push(text); };
  const look = () => {
    const bots = document.querySelectorAll('#image-chat-history [data-testid=bot]');
    note(seen.bot, bots.length ? bots[bots.length - 1].innerText.trim() : '');
    const status = document.querySelector('#image-chat-status');
    note(seen.status, status ? status.innerText.trim() : '');
  };
  look();
  window.__watch?.disconnect();
  window.__watch = new MutationObserver(look);
  window.__watch.observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def mobile_sam_repo(tmp_path_factory):
    """`dhkim2810/MobileSAM` as the hub holds it: `mobile_sam.pt`, MobileSAM's state dict (random weights)
    as tests/test_sam_download.py writes it."""
    repo = tmp_path_factory.mktemp("mobile-sam-repo")
    torch.manual_seed(0)
    torch.save(Sam(VARIANTS["mobile_sam"]).state_dict(), repo / "mobile_sam.pt")
    return repo


def _image_bytes(page, locator) -> np.ndarray:
    """The pixels of the <img> `locator` shows, fetched from the app as the browser did."""
    src = locator.evaluate("img => img.src")
    response = page.request.get(src)
    assert response.ok, (src, response.status)
    return np.asarray(Image.open(io.BytesIO(response.body())).convert("RGB"), dtype=np.int16)


def _set_sampling(page, **values) -> None:
    for name, value in values.items():
        box = page.locator(f"#image-chat-{name.replace('_', '-')} input[type=number]")
        box.fill(str(value))
        box.press("Enter")


def _streamed(page, history_turns: int) -> list[str]:
    """Wait for the reply started last to end (Stop is Send again, the status has its statistics), with
    `history_turns` messages then shown; the answer's texts the page showed on the way, the final last."""
    page.locator("#image-chat-status").get_by_text("tok/s").wait_for(timeout=SLOW)
    page.locator("#image-chat-send").wait_for(state="visible", timeout=SLOW)
    history = page.locator("#image-chat-history .message-row")
    assert history.count() == history_turns, history.all_inner_texts()
    seen = page.evaluate("window.__seen")
    texts = [t for t in seen["bot"] if t]
    final = page.locator("#image-chat-history [data-testid=bot]").last.inner_text().strip()
    assert final and texts and texts[-1] == final, (texts, final)
    # streamed: the answer grew on the page, at least two different partial texts before the final one,
    # while the status said so
    assert len(texts) >= 3, texts
    assert any("generating…" in line for line in seen["status"]), seen["status"]
    return texts


def test_click_mask_ask_about_this_streams_from_the_downloaded_models(browser, tmp_path, folder,  # noqa: F811
                                                                       mobile_sam_repo, monkeypatch):
    from conftest import launched

    (folder / "chat_template.jinja").write_text(TEMPLATE)  # SmolVLM-Instruct's template, as the hub's repo has
    cache, hub_cache = tmp_path / "cache", tmp_path / "hf-cache"  # both empty: everything downloads
    with serving({MOBILE_SAM: mobile_sam_repo, SMOLVLM: folder}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        with launched(tmp_path / "launch.log", cache, "--data-dir", str(tmp_path / "data")) as app, \
                browser_page(browser, app.url) as page:
            page.locator("#tools-status").wait_for()
            _no_demo_notice(page)  # the page is built for the real models, not their demos
            assert hub.ranges == []  # nothing downloads before its tool's first use

            # Image chat's answers: greedy, without a repetition penalty, the random SmolVLM never says its end
            # token, so each reply runs its 300 tokens and streams in many updates (the page gets one per
            # 50 ms at most; 300 decode steps take longer on any machine).
            page.get_by_role("tab", name="Image chat").click()
            _set_sampling(page, temperature=0, repetition_penalty=1, max_new_tokens=300)

            # Segment: an image → MobileSAM downloads, loads and reads it
            page.get_by_role("tab", name="Segment").click()
            page.locator("#segment-canvas input[type=file]").set_input_files("assets/examples/shapes.jpg")
            status = page.locator("#segment-status")
            status.get_by_text("picture read 1×").wait_for(timeout=SLOW)
            image = page.locator("#segment-canvas img").first
            image.wait_for()
            page.wait_for_function("() => document.querySelector('#segment-canvas img').complete")
            before = _image_bytes(page, image)
            shown_src = image.get_attribute("src")

            # a click → a mask, drawn over the picture, with three candidates
            box = image.bounding_box()
            image.click(position={"x": box["width"] * 0.3, "y": box["height"] * 0.4})
            status.get_by_text("1 point").wait_for()
            page.wait_for_function("src => { const i = document.querySelector('#segment-canvas img');"
                                   " return i && i.getAttribute('src') !== src && i.complete; }", arg=shown_src)
            page.locator("#segment-candidates img").nth(2).wait_for()
            said = status.inner_text()
            assert "mask is empty" not in said and "Demo" not in said, said
            assert page.get_by_role("button", name="Download chosen mask (PNG)").is_enabled()  # a non-empty mask
            after = _image_bytes(page, image)
            assert after.shape == before.shape
            changed = np.abs(after - before).max(axis=2) > 40  # the mask's tint and outline (JPEG noise is less)
            assert changed.mean() > 0.005, changed.mean()

            # Ask about this → Image chat, with the selected object, answered (SmolVLM downloads first)
            page.evaluate(WATCH)
            page.locator("#segment-question textarea").fill("What shape is this?")
            page.get_by_role("button", name="Ask about this").click()
            page.locator("#image-chat-history").get_by_text("What shape is this?").wait_for(timeout=SLOW)
            assert page.get_by_role("tab", name="Image chat").get_attribute("aria-selected") == "true"
            shown = page.locator("#image-chat-image img").first
            shown.wait_for()
            assert "selection-" in shown.get_attribute("src")
            page.wait_for_function("() => document.querySelector('#image-chat-image img').complete")
            crop = _image_bytes(page, shown)  # the object, its surroundings dimmed: not the whole picture
            whole = np.asarray(Image.open("assets/examples/shapes.jpg").convert("RGB"), dtype=np.int16)
            assert crop.shape != whole.shape or np.abs(crop - whole).mean() > 10, crop.shape
            first = _streamed(page, 2)

            # a follow-up typed in Image chat, about the same object, in the same conversation (the random
            # answer's invalid UTF-8 reads back as U+FFFD, 3 tokens each, so the first turn no longer fits the
            # tiny model's 1024 tokens and a notice says so: the picture and the new question still go)
            page.evaluate(WATCH)
            question = page.get_by_placeholder("Ask about the image, Enter to send")
            question.fill("And what colour is it?")
            question.press("Enter")
            page.locator("#image-chat-history").get_by_text("And what colour is it?").wait_for()
            _streamed(page, 4)
            assert page.locator("#image-chat-history").get_by_text("What shape is this?").count() == 1
            assert "selection-" in page.locator("#image-chat-image img").first.get_attribute("src")
            assert first[-1] in page.locator("#image-chat-history").inner_text()  # the first answer stays

            # the page says the downloaded models run: the start-up report (refreshed every 3 s) tells of both
            # downloads and loads, the tools line names both models, and no demo notice shows anywhere
            page.get_by_text("Start-up: what runs where, and why").click()
            report = page.locator("#startup-report")
            report.get_by_text("segment: downloading mobile_sam (40 MB)").wait_for()
            report.get_by_text(f"image chat: downloading {SMOLVLM} (0.5 GB)").wait_for()
            report.get_by_text("image chat ready in").wait_for()
            _no_demo_notice(page)
            tools = page.locator("#tools-status")
            tools.get_by_text("MobileSAM").wait_for()
            tools.get_by_text(f"SmolVLM over {SMOLVLM}").wait_for()
            assert "MiniGPT-4" not in tools.inner_text() and "demo/sam" not in tools.inner_text()

        log = app.log.read_text()
        assert "Traceback" not in log, log[-3000:]
        asked = {name for name, _ in hub.ranges}  # every file body the hub sent
    assert "mobile_sam.pt" in asked and "config.json" in asked and any(n.endswith(".safetensors") for n in asked), asked
    assert (cache / "sam" / "mobile_sam.pt").read_bytes() == (mobile_sam_repo / "mobile_sam.pt").read_bytes()
    assert list((hub_cache / f"models--{SMOLVLM.replace('/', '--')}" / "snapshots").glob("*/config.json"))
