"""The first screen as a new user sees it, on a laptop (1440 × 900) and a phone (390 × 844), without scrolling:
the message box and the status line under it in view (Regenerate and Edit too on the laptop), the open
conversation's Rename and Delete in view with 50 conversations in the list, and none of them on a fresh page,
where they would have nothing to act on; one way to delete a conversation (not Gradio's trash icon too)."""

import contextlib
import json
import re

import pytest

from test_browser import CHROMIUM, FLAGS, _import, send, sync_api  # noqa: F401 - skips where Chromium is missing

pytestmark = pytest.mark.browser
SCREENS = {"laptop": (1440, 900), "phone": (390, 844)}
PHONE_TOGGLE = "#chat-sidebar-toggle"


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield chromium
        chromium.close()


@contextlib.contextmanager
def screen(browser, url: str, name: str):
    width, height = SCREENS[name]
    phone = name == "phone"
    context = browser.new_context(viewport={"width": width, "height": height}, is_mobile=phone, has_touch=phone)
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        page.get_by_text("What can I help with?").wait_for()
        yield page
    finally:
        context.close()


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
