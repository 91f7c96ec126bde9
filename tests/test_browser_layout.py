"""The first screen as a new user sees it, on a laptop (1440 × 900) and a phone (390 × 844), without scrolling:
the message box and the status line under it in view (Regenerate and Edit too on the laptop), the open
conversation's Rename and Delete in view with 50 conversations in the list, and none of them on a fresh page,
where they would have nothing to act on; one way to delete a conversation (not Gradio's trash icon too)."""

import json
import re

import pytest

from test_browser import SCREENS, _import, browser, screen, send  # noqa: F401 - its Chromium (skips without one)

pytestmark = pytest.mark.browser
PHONE_TOGGLE = "#chat-sidebar-toggle"


def in_view(page, selector: str) -> bool:
    """Whether the element is wholly inside the window as it stands (the page not scrolled)."""
    box = page.locator(selector).first.bounding_box()
    size = page.viewport_size
    return box is not None and box["height"] > 0 and 0 <= box["x"] and box["x"] + box["width"] <= size["width"] \
        and 0 <= box["y"] and box["y"] + box["height"] <= size["height"]


def archive(path, n: int, name: str):
    """`n` chat conversations in the app's export format, as `Export all` writes them."""
    conversations = [{"tool": "chat", "title": f"{name} trip {i}", "messages": [
        {"id": 0, "role": "user", "content": f"Plan {name} trip {i}"},
        {"id": 1, "role": "assistant", "content": "A plan.", "parent": 0}]} for i in range(n)]
    path.write_text(json.dumps({"format": "ai-studio-conversations", "version": 1, "conversations": conversations}))
    return path


@pytest.mark.parametrize("name", SCREENS)
def test_the_message_box_status_line_and_the_conversations_actions_stay_in_view(browser, running_app, tmp_path,
                                                                               name):
    phone = name == "phone"
    with screen(browser, running_app.url, name) as page:
        if phone:
            page.locator(PHONE_TOGGLE).click()
        page.locator("#chat-sidebar").get_by_role("button", name="New chat").wait_for()
        assert not page.locator("#chat-rename").is_visible() and not page.locator("#chat-delete").is_visible()
        if phone:
            page.locator(PHONE_TOGGLE).click()
        send(page, "Hi")
        page.locator("#chat-status").get_by_text("tok/s").wait_for()
        assert page.locator('#chat-history button[aria-label="Copy conversation"]').is_visible()
        assert not page.locator('#chat-history button[aria-label="Clear"]').is_visible()  # Delete is the one way
        page.evaluate("window.scrollTo(0, 0)")
        shown = ["#chat-input textarea", "#chat-status"] + ([] if phone else ["#chat-regenerate", "#chat-edit"])
        assert [s for s in shown if not in_view(page, s)] == [], name

        if phone:
            page.locator(PHONE_TOGGLE).click()
        _import(page, archive(tmp_path / "fifty.json", 50, name))
        page.locator("#chat-status").get_by_text("Imported 50 conversations").wait_for()
        chosen = page.locator("#chat-conversations").get_by_text(re.compile(rf"^{name} trip 3 ·"))
        chosen.wait_for()
        chosen.click()
        page.locator("#chat-history").get_by_text(f"Plan {name} trip 3").wait_for()
        if phone:  # choosing folded the list away: opened again, its actions come first
            page.locator(PHONE_TOGGLE).click()
        page.locator("#chat-rename").wait_for()
        page.evaluate("window.scrollTo(0, 0)")
        assert [s for s in ("#chat-rename", "#chat-delete") if not in_view(page, s)] == [], name
        if not phone:
            assert [s for s in shown if not in_view(page, s)] == [], name


JARGON = ("cache rows", "batch up to", "prefill in chunks", "instead of TensorRT", "--quant", "encoder runs",
          "decoder ", "-wide ViT", "Runs as")


@pytest.fixture(scope="module")
def offline_app(tmp_path_factory):
    """The app as a new user meets it with no connection to the hub and nothing downloaded."""
    from conftest import launched

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        with launched(tmp_path_factory.mktemp("offline") / "launch.log", tmp_path_factory.mktemp("cache")) as app:
            yield app


def rows_of(page) -> dict[str, dict[str, str]]:
    """The Models tab's table as {model: {column: cell}}, read from the page (Gradio draws its rows as a grid)."""
    headers = [h.strip() for h in page.locator("#models-table thead th").all_inner_texts() if h.strip()]
    found = {}
    for row in page.locator("#models-table [role=row].virtual-row").all():
        cells = [c.strip() for c in row.locator("[role=gridcell]").all_inner_texts()]
        found[cells[0]] = dict(zip(headers, cells))
    return found


@pytest.mark.parametrize("name", SCREENS)
def test_offline_the_image_tabs_say_their_demo_before_any_upload_in_a_users_words(browser, offline_app, name):
    """Each image tab states, before any upload, that its demo runs and what brings the real model; the Models
    tab names the demos as what those tools use, fits a laptop's width and offers nothing to delete where
    nothing can be; the words on screen (header, the start-up panel's first lines, Segment's status) are a
    user's, the engine's terms folded into the panel's details."""
    with screen(browser, offline_app.url, name) as page:
        page.get_by_role("tab", name="Image chat", exact=True).click()
        notice = page.locator("#image-chat-demo")
        notice.get_by_text("you are offline").wait_for()
        assert "SmolVLM-256M-Instruct (0.5 GB)" in notice.inner_text()
        assert name == "phone" or in_view(page, "#image-chat-input textarea")  # under the notice, still in view
        page.get_by_role("tab", name="Segment", exact=True).click()
        banner = page.locator("#segment-demo")
        banner.get_by_text("you are offline").wait_for()
        assert "--sam /path/to/mobile_sam.pt" in banner.inner_text() and \
            banner.get_by_role("link", name="mobile_sam.pt").get_attribute("href").endswith("/mobile_sam.pt")

        page.get_by_role("tab", name="Models", exact=True).click()
        page.locator("#models-table").get_by_text("demo/sam-tiny").first.wait_for()
        rows = rows_of(page)
        columns = " ".join(next(iter(rows.values())))
        assert rows["demo/sam-tiny"]["In use by"] == "segment" and rows["mobile_sam"]["In use by"] == "", rows
        assert rows["mobile_sam"]["Where"] == "not here: downloads once online (40 MB)", rows["mobile_sam"]
        assert "image chat" in [r["In use by"] for model, r in rows.items() if model.startswith("demo/")], rows
        assert page.locator("#models-nothing-to-delete").is_visible()
        assert not page.locator("#models-ask-delete").is_visible()  # no red button beside an empty list
        if name == "laptop":  # every column in sight, no sideways scrolling
            last = page.locator("#models-table thead th").filter(has_text="In use by").first.bounding_box()
            assert last["x"] + last["width"] <= SCREENS[name][0], last

        page.get_by_role("tab", name="Segment", exact=True).click()
        page.locator("#segment-canvas input[type=file]").set_input_files("assets/examples/shapes.jpg")
        status = page.locator("#segment-status")
        status.get_by_text("picture read").wait_for()
        image = page.locator("#segment-canvas img").first
        box = image.bounding_box()
        image.click(position={"x": box["width"] * 0.3, "y": box["height"] * 0.4})
        status.get_by_text("1 point").wait_for()
        page.get_by_text("Start-up: what runs where, and why").click()
        report = page.locator("#startup-report")
        report.get_by_text("segment ready in").first.wait_for()
        shown = status.inner_text() + page.locator("#tools-status").inner_text() + report.inner_text() + columns
        assert not [term for term in JARGON if term in shown], shown
        assert "demo SAM (random weights)" in page.locator("#tools-status").inner_text() or name == "phone"
