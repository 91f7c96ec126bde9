"""The Chat tab in a real browser (headless Debian Chromium driven by Playwright)."""

import contextlib
import os
import re

import numpy as np
import pytest
from PIL import Image

# Run alone, after the other tests (scripts/test.sh): the page is clicked and waited on, and with another
# test worker loading both cores its clicks and waits timed out (three tests at once, 2026-11-27).
pytestmark = pytest.mark.browser
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in requirements-dev.txt")
CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip("Debian chromium is not installed (apt-get install chromium); "
                "tests/test_app_e2e.py covers the same endpoints through gradio_client", allow_module_level=True)

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module (Playwright's sync API runs one at a time)."""
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield chromium
        chromium.close()


@contextlib.contextmanager
def browser_page(browser, url: str):
    """A page on `url` in a fresh browser context (its own storage, as another browser would have)."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        yield page
    finally:
        context.close()


@pytest.fixture(scope="module")
def page(browser, running_app):
    with browser_page(browser, running_app[0]) as page:
        yield page


# Greedy without a repetition penalty, this prompt makes the demo model write 4,000 tokens without an end
# token (seen: "ended: length"): a reply that is still running when Stop comes, whatever the CPU's speed.
ENDLESS = dict(max_new_tokens=4000, temperature=0, repetition_penalty=1)


def send(page, text: str) -> None:
    box = page.get_by_placeholder("Type a message, Enter to send")
    box.fill(text)
    box.press("Enter")


def test_chat_streams_survives_reload_and_clears(page):
    send(page, "Hello from the browser")
    page.locator("#chat-status").get_by_text("tok/s").wait_for()
    assert page.get_by_text("Hello from the browser").count() >= 1
    assert page.get_by_text("random weights").count() >= 1  # the demo banner

    page.wait_for_timeout(1500)  # which conversation is open is kept in the browser right after the reply
    page.reload()
    page.locator("#chat-history").get_by_text("Hello from the browser").wait_for()  # reopened from the store

    history = page.locator("#chat-history")
    page.get_by_role("button", name="New chat").click()
    history.get_by_text("Hello from the browser").first.wait_for(state="detached")
    page.wait_for_timeout(1500)  # "no conversation open" is kept right after the clear
    page.reload()
    # the conversation itself is kept: the sidebar lists it by its first question (waited for: the page's
    # load fills the sidebar, and reopens a conversation where one was open)
    listed = page.locator("#chat-conversations").get_by_text("Hello from the browser")
    listed.first.wait_for()
    page.wait_for_timeout(1500)
    assert history.get_by_text("Hello from the browser").count() == 0  # cleared stays cleared
    assert listed.count() == 1


def test_stop_keeps_the_partial_reply(page):
    set_controls(page, **ENDLESS)
    send(page, "A very long story please")
    page.locator("#chat-status").get_by_text("generating…").wait_for()
    reply = page.locator("#chat-history [data-testid=bot]").last
    page.wait_for_function("() => { const b = [...document.querySelectorAll('#chat-history [data-testid=bot]')]"
                           ".pop(); return b && b.innerText.trim().length > 0; }")  # part of the reply is shown
    page.get_by_role("button", name="Stop").first.click()
    page.locator("#chat-status").get_by_text("Stopped: the reply so far is kept.").wait_for()
    page.wait_for_timeout(1000)  # the reply's last update (the text up to the step Stop ended) lands
    kept = reply.inner_text().strip()
    page.wait_for_timeout(2000)
    # The partial reply stays, and stopped growing: without Stop, this greedy reply runs to 4000 tokens.
    assert kept and reply.inner_text().strip() == kept


def test_segment_tab_clicks_undo_and_box(page):
    page.get_by_role("tab", name="Segment").click()
    page.locator("#segment-canvas input[type=file]").set_input_files("assets/examples/shapes.jpg")
    status = page.locator("#segment-status")
    status.get_by_text("picture read").wait_for()
    image = page.locator("#segment-canvas img").first
    image.wait_for()
    box = image.bounding_box()
    image.click(position={"x": box["width"] * 0.25, "y": box["height"] * 0.4})
    status.get_by_text("1 point ").wait_for()
    runs = status.inner_text().split("picture read ")[1].split("×")[0]
    page.locator("#segment-candidates img").nth(2).wait_for()  # three candidates
    captions = re.findall(r"quality (-?[0-9.]+)", page.locator("#segment-candidates").inner_text())
    assert len(captions) >= 3 and all(0 <= float(q) <= 1 for q in captions), captions  # SAM's raw IoU, clamped
    buttons = page.locator("#segment-candidates button").evaluate_all(
        "bs => bs.map(b => b.getAttribute('aria-label') || b.title || b.innerText)")
    assert all(b.startswith("Thumbnail") for b in buttons), buttons  # no zip of thumbnails beside the real mask
    page.get_by_label("Background (−)").check()
    image.click(position={"x": box["width"] * 0.7, "y": box["height"] * 0.6})
    status.get_by_text("2 points").wait_for()
    assert status.inner_text().split("picture read ")[1].split("×")[0] == runs  # same image: no re-encode
    page.get_by_role("button", name="Undo").click()
    status.get_by_text("1 point ").wait_for()
    page.get_by_label("Box (two clicks: opposite corners)").check()
    image.click(position={"x": box["width"] * 0.1, "y": box["height"] * 0.1})
    status.get_by_text("box: now click its opposite corner").wait_for()  # the first corner, marked and said
    image.click(position={"x": box["width"] * 0.5, "y": box["height"] * 0.6})
    status.get_by_text("1 point + box").wait_for()
    assert "opposite corner" not in status.inner_text()
    with page.expect_download() as download:  # the full-size mask, made when asked for
        page.get_by_role("button", name="Download chosen mask (PNG)").click()
    mask = Image.open(download.value.path())
    assert mask.format == "PNG" and mask.size == (800, 600) and set(np.unique(np.asarray(mask))) <= {0, 255}
    page.get_by_role("button", name="Segment everything").click()
    status.get_by_text("Segment everything:").wait_for()
    assert page.locator("#segment-candidates img").count() == 0  # the last prompt's candidates are gone
    assert page.get_by_role("button", name="Download chosen mask (PNG)").is_disabled()  # nothing stale to save


def test_image_chat_tab_two_turns_and_restart(page):
    page.get_by_role("tab", name="Image chat").click()
    page.locator("#image-chat-image input[type=file]").set_input_files("assets/examples/fruit_bowl.jpg")
    page.locator("#image-chat-image img").first.wait_for()
    box = page.get_by_placeholder("Ask about the image, Enter to send")
    status = page.locator("#image-chat-status")
    box.fill("What is unusual here?")
    box.press("Enter")
    status.get_by_text("tok/s").wait_for()
    # offline (no hub here), the MiniGPT-4 demo answers, as the tab said before the upload
    page.locator("#image-chat-demo").get_by_text("you are offline").wait_for(timeout=20_000)
    box.fill("Tell me more about the bowl")
    box.press("Enter")
    page.get_by_text("Tell me more about the bowl").wait_for()
    status.get_by_text("tok/s").wait_for()
    assert page.get_by_text("What is unusual here?").count() >= 1
    assert page.locator("#image-chat-image img").count() >= 1  # the image stays beside the conversation
    page.get_by_role("button", name="Restart conversation").click()
    page.locator("#image-chat-history").get_by_text("What is unusual here?").wait_for(state="detached")
    # the conversation is kept: the sidebar lists it by its first question
    page.locator("#image-chat-conversations").get_by_text("What is unusual here?").wait_for()


def set_controls(page, **values) -> None:
    """Type values into the Chat tab's sampling boxes (a fixed seed makes the demo's replies the same every run)."""
    for name, value in values.items():
        box = page.locator(f"#chat-{name.replace('_', '-')} input[type=number]")
        box.fill(str(value))
        box.press("Enter")


def _chat_texts(page) -> list[str]:
    return [t.strip() for t in page.locator("#chat-history [data-testid=user], #chat-history [data-testid=bot]")
            .all_inner_texts()]


def _new_chat(page) -> None:
    page.get_by_role("tab", name="Chat", exact=True).click()
    page.get_by_role("button", name="New chat").click()
    page.locator("#chat-history .message-row").first.wait_for(state="detached")
    for control, value in (("#chat-max-new-tokens", "12"), ("#chat-temperature", "1")):
        page.locator(f"{control} input[type=number]").fill(value)
        page.locator(f"{control} input[type=number]").press("Enter")


def _version(page, label: str) -> None:
    page.locator("#chat-version-label").get_by_text(label).wait_for()


def test_regenerate_keeps_every_reply_as_a_version_and_the_meter_shows_the_context(page, tmp_path):
    _new_chat(page)
    send(page, "Tell me something")
    status = page.locator("#chat-status")
    status.get_by_text("tok/s").wait_for()
    assert "context: " in status.inner_text() and " of 4096 tokens" in status.inner_text()
    first = _chat_texts(page)
    assert len(first) == 2 and not page.locator("#chat-versions").is_visible()  # one version: no switcher
    page.get_by_role("button", name="Regenerate").click()
    _version(page, "Reply 2 / 2")
    status.get_by_text("tok/s").wait_for()
    again = _chat_texts(page)
    assert len(again) == 2 and again[0] == first[0]
    page.get_by_role("button", name="‹ older").click()
    _version(page, "Reply 1 / 2")
    assert _chat_texts(page) == first  # the first reply, kept
    page.get_by_role("button", name="newer ›").click()
    _version(page, "Reply 2 / 2")
    assert _chat_texts(page) == again
    with page.expect_download() as download:  # both replies are in the conversation's export
        page.locator("#chat-export-this").click()
    download.value.save_as(tmp_path / "versions.json")
    (exported,) = __import__("json").loads((tmp_path / "versions.json").read_text())["conversations"]
    replies = [m for m in exported["messages"] if m["role"] == "assistant"]
    assert len(replies) == 2 and replies[0]["parent"] == replies[1]["parent"]


def test_edit_can_be_cancelled_and_keeps_the_old_question_as_a_version(page):
    _new_chat(page)
    send(page, "Wrong **question**")
    page.locator("#chat-status").get_by_text("tok/s").wait_for()
    before = _chat_texts(page)
    sidebar = page.locator("#chat-conversations")
    sidebar.get_by_text("Wrong question · just now").wait_for()  # a plain-text title, and when
    page.get_by_role("button", name="Edit last").click()
    box = page.get_by_placeholder("Type a message, Enter to send")
    page.wait_for_function("() => document.querySelector('#chat-history .message-row') === null")
    assert box.input_value() == "Wrong **question**"
    page.get_by_role("button", name="Cancel edit").click()
    page.locator("#chat-history .message-row").nth(1).wait_for()
    assert _chat_texts(page) == before and box.input_value() == ""  # as it was
    page.get_by_role("button", name="Edit last").click()
    page.wait_for_function("() => document.querySelector('#chat-history .message-row') === null")
    box.fill("Right question")
    box.press("Enter")
    _version(page, "Your message 2 / 2")
    page.locator("#chat-status").get_by_text("tok/s").wait_for()
    texts = _chat_texts(page)
    assert texts[0] == "Right question" and len(texts) == 2
    sidebar.get_by_text("Right question").wait_for()  # the title follows the edited first message
    page.get_by_role("button", name="‹ older").click()
    _version(page, "Your message 1 / 2")
    assert _chat_texts(page) == before  # the old question, with its reply


def test_delete_offers_undo(page):
    _new_chat(page)
    send(page, "Keep me please")
    page.locator("#chat-status").get_by_text("tok/s").wait_for()
    sidebar = page.locator("#chat-conversations")
    sidebar.get_by_text("Keep me please").wait_for()
    page.get_by_role("button", name="Delete", exact=True).click()
    sidebar.get_by_text("Keep me please").wait_for(state="detached")
    page.locator("#chat-status").get_by_text("Deleted “Keep me please”.").wait_for()
    page.get_by_role("button", name="Undo delete").click()
    sidebar.get_by_text("Keep me please").wait_for()
    page.locator("#chat-history").get_by_text("Keep me please").wait_for()  # reopened, messages and all
    assert not page.get_by_role("button", name="Undo delete").is_visible()


def test_a_new_chat_greets_with_examples_and_send_becomes_stop(page):
    _new_chat(page)
    page.get_by_text("What can I help with?").wait_for()
    page.get_by_text("Write a Python function that tells whether a word is a palindrome.").click()
    box = page.get_by_placeholder("Type a message, Enter to send")
    page.wait_for_function("() => document.querySelector('#chat-input textarea').value.includes('palindrome')")
    set_controls(page, **ENDLESS)
    where = page.locator("#chat-send").bounding_box()
    box.press("Enter")
    stop = page.locator("#chat-stop")
    stop.wait_for(state="visible")
    assert not page.locator("#chat-send").is_visible()
    placed = stop.bounding_box()  # in Send's place, Send's size
    assert abs(placed["x"] - where["x"]) < 2 and abs(placed["width"] - where["width"]) < 2, (placed, where)
    page.locator("#chat-status").get_by_text("generating…").wait_for()
    box.press("Escape")  # Escape in the box stops it
    page.locator("#chat-status").get_by_text("Stopped: the reply so far is kept.").wait_for()
    page.locator("#chat-send").wait_for(state="visible")
    page.wait_for_function("() => document.activeElement === document.querySelector('#chat-input textarea')")
    set_controls(page, max_new_tokens=12, temperature=1, repetition_penalty=1.05)


def test_a_mistake_is_a_toast_that_leaves_the_page_as_it_was(page, running_app):
    page.get_by_role("tab", name="Image chat").click()
    page.get_by_role("button", name="New conversation").click()
    box = page.get_by_placeholder("Ask about the image, Enter to send")
    box.fill("What is this?")
    box.press("Enter")  # no picture yet
    page.locator(".toast-body").get_by_text("upload an image first").wait_for()
    page.locator("#image-chat-send").wait_for(state="visible")
    assert box.input_value() == "What is this?"  # the question stays to send once there is a picture
    assert page.get_by_text("Error", exact=True).count() == 0  # no red badges over the components
    page.get_by_role("tab", name="Models").click()
    page.get_by_role("button", name="Delete…").click()  # no model picked
    page.locator(".toast-body").get_by_text("pick the model to delete").wait_for()
    assert page.get_by_text("Error", exact=True).count() == 0
    log = running_app.log.read_text()
    assert "not done (a user's request): pick the model to delete" in log and "Traceback" not in log
    page.get_by_role("tab", name="Chat", exact=True).click()


SCREENS = {"laptop": (1440, 900), "phone": (390, 844)}


@contextlib.contextmanager
def screen(browser, url: str, name: str):
    """The app on a laptop's screen (1440 × 900) or a phone's (390 × 844, touch), its first screen loaded."""
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


def phone_page(browser, url: str):
    return screen(browser, url, "phone")


def test_the_first_screen_at_phone_width_shows_the_tabs_and_folds_the_sidebar(browser, running_app):
    with phone_page(browser, running_app.url) as phone:
        tabs = phone.get_by_role("tab", name="Chat", exact=True).bounding_box()
        assert phone.evaluate("window.scrollY") == 0 and tabs["y"] + tabs["height"] <= 844
        assert not phone.locator("#chat-sidebar").is_visible()
        assert not phone.locator("#tools-status").is_visible()  # engine details: behind the start-up panel
        phone.get_by_text("Start-up: what runs where, and why").click()
        phone.locator("#startup-report").get_by_text("Chat:").first.wait_for()
        phone.get_by_role("button", name="☰ Conversations").first.click()
        phone.locator("#chat-sidebar").get_by_role("button", name="New chat").wait_for()
        phone.get_by_role("tab", name="Models").click()
        phone.locator("#models-table").get_by_text("demo/qwen-v1-tiny").first.wait_for()
        assert phone.evaluate("document.documentElement.scrollWidth") <= 390  # the table scrolls in its box


def _import(page, path) -> None:
    with page.expect_file_chooser() as chooser:
        page.get_by_role("button", name="Import conversation").click()
    chooser.value.set_files(str(path))


def test_export_and_import_round_trip_with_highlighted_code(page, tmp_path):
    _new_chat(page)
    page.locator("#chat-preset input").click()
    page.get_by_role("option", name="Coding helper").click()
    page.wait_for_function("() => document.querySelector('#chat-system textarea').value.includes('expert programmer')")
    send(page, "Show code")
    page.locator("#chat-status").get_by_text("tok/s").wait_for()
    before = _chat_texts(page)
    with page.expect_download() as download:
        page.get_by_role("button", name="Export JSON").click()
    exported = tmp_path / "conversation.json"
    download.value.save_as(exported)
    data = __import__("json").loads(exported.read_text())
    assert data["system_prompt"].startswith("You are an expert programmer")
    assert [m["content"] for m in data["messages"]][0] == "Show code"
    with page.expect_download() as download:
        page.get_by_role("button", name="Export Markdown").click()
    markdown = tmp_path / "conversation.md"
    download.value.save_as(markdown)
    assert "### User\n\nShow code" in markdown.read_text()

    # a conversation with a code block, imported: it renders highlighted
    data["messages"].append({"role": "user", "content": "And in Python?"})
    data["messages"].append({"role": "assistant", "content": "```python\ndef square(x):\n    return x * x\n```"})
    with_code = tmp_path / "with_code.json"
    with_code.write_text(__import__("json").dumps(data))
    page.get_by_role("button", name="New chat").click()
    page.locator("#chat-history .message-row").first.wait_for(state="detached")
    _import(page, with_code)
    page.locator("#chat-status").get_by_text("Imported 4 messages.").wait_for()
    page.locator("#chat-history pre code").get_by_text("def square(x):").wait_for()  # rendered after the text
    texts = _chat_texts(page)
    assert texts[:2] == before and "def square(x):" in texts[3]
    code = page.locator("#chat-history pre code").first
    assert code.locator("span").count() > 0  # tokens wrapped by the highlighter

    _import(page, markdown)  # Markdown reads back too
    page.locator("#chat-status").get_by_text("Imported 2 messages.").wait_for()
    assert _chat_texts(page) == before


def test_ask_about_the_selected_object(page):
    page.get_by_role("tab", name="Segment").click()
    page.locator("#segment-canvas input[type=file]").set_input_files("assets/examples/shapes.jpg")
    status = page.locator("#segment-status")
    status.get_by_text("picture read").wait_for()
    page.get_by_label("Points").check()
    page.get_by_role("button", name="Clear prompts").click()  # an earlier test may have left prompts
    status.get_by_text("0 points").wait_for()
    image = page.locator("#segment-canvas img").first
    box = image.bounding_box()
    image.click(position={"x": box["width"] * 0.3, "y": box["height"] * 0.4})
    status.get_by_text("1 point").wait_for()
    page.locator("#segment-question textarea").fill("What colour is this shape?")
    page.get_by_role("button", name="Ask about this").click()
    page.locator("#image-chat-history").get_by_text("What colour is this shape?").wait_for()  # asked in its tab
    page.locator("#image-chat-send").wait_for(state="visible")  # and answered: Stop is Send again
    assert "tok/s" in page.locator("#image-chat-status").inner_text()
    assert page.get_by_role("tab", name="Image chat").get_attribute("aria-selected") == "true"
    shown = page.locator("#image-chat-image img").first
    shown.wait_for()
    assert "selection-" in shown.get_attribute("src")  # the object, its surroundings dimmed
    # the new conversation is in image chat's sidebar without a reload
    page.locator("#image-chat-conversations").get_by_text("What colour is this shape?").wait_for()


def test_conversations_are_kept_renamed_searched_deleted_and_survive_a_restart(browser, tmp_path, studio_cache):
    """Three chats in the sidebar; rename one; search finds a word of an old reply; delete one; after a
    restart of the app on the same data folder the other two are there, with their messages."""
    from conftest import launched

    data = ["--data-dir", str(tmp_path / "data"), "--context", "1024"]
    questions = ["First question about apples", "Second one about bananas", "Third about cherries"]
    with launched(tmp_path / "first.log", studio_cache, *data) as (url, *_), browser_page(browser, url) as page:
        sidebar = page.locator("#chat-conversations")
        set_controls(page, seed=5)  # the same replies every run: the search below takes a word of the first
        replies = []
        for i, question in enumerate(questions):
            if i:
                page.get_by_role("button", name="New chat").click()
                page.locator("#chat-history").get_by_text(questions[i - 1]).wait_for(state="detached")
            send(page, question)
            page.locator("#chat-status").get_by_text("tok/s").wait_for()
            replies.append(page.locator("#chat-history [data-testid=bot]").last.inner_text())
            sidebar.get_by_text(question).wait_for()
        assert sidebar.locator("label").count() == 3

        sidebar.get_by_text(questions[1]).click()  # open the second, rename it
        page.locator("#chat-history").get_by_text(questions[1]).wait_for()
        page.locator("#chat-title textarea, #chat-title input").first.fill("Fruit talk")
        page.locator("#chat-title textarea, #chat-title input").first.press("Enter")  # Enter renames
        sidebar.get_by_text("Fruit talk").wait_for()

        word = max("".join(c if c.isalnum() else " " for c in replies[0]).split(), key=len)
        page.locator("#chat-search textarea, #chat-search input").first.fill(word)
        if word not in replies[2]:
            sidebar.get_by_text(questions[2]).wait_for(state="detached")  # the list narrows to the matches
        assert sidebar.get_by_text(questions[0]).count() == 1  # found by a word of its reply
        search = page.locator("#chat-search textarea, #chat-search input").first
        search.fill("fruit")  # the renamed one, by its title, whatever the case
        sidebar.get_by_text(questions[0]).wait_for(state="detached")
        assert sidebar.get_by_text("Fruit talk").count() == 1
        search.fill("qqzzxx")
        sidebar.get_by_text("No conversations match “qqzzxx”").wait_for()
        search.fill("")
        sidebar.get_by_text(questions[2]).wait_for()

        sidebar.get_by_text(questions[2]).click()  # open the third, delete it
        page.locator("#chat-history").get_by_text(questions[2]).wait_for()
        page.get_by_role("button", name="Delete").click()
        sidebar.get_by_text(questions[2]).wait_for(state="detached")
        assert sidebar.locator("label").count() == 2

        page.get_by_role("tab", name="Image chat").click()  # an image-chat conversation keeps its picture
        page.locator("#image-chat-image input[type=file]").set_input_files("assets/examples/fruit_bowl.jpg")
        box = page.get_by_placeholder("Ask about the image, Enter to send")
        box.fill("What fruit is in the bowl?")
        box.press("Enter")
        page.locator("#image-chat-status").get_by_text("tok/s").wait_for()
        page.locator("#image-chat-conversations").get_by_text("What fruit is in the bowl?").wait_for()

    with launched(tmp_path / "second.log", studio_cache, *data) as (url, *_), browser_page(browser, url) as page:
        sidebar = page.locator("#chat-conversations")
        sidebar.get_by_text("Fruit talk").wait_for()
        assert sidebar.locator("label").count() == 2 and sidebar.get_by_text(questions[0]).count() == 1
        sidebar.get_by_text(questions[0]).click()
        history = page.locator("#chat-history")
        history.get_by_text(questions[0]).wait_for()
        sync_api.expect(history).to_contain_text(replies[0].strip()[:20])  # the reply came back from the store (its
        # markdown renders a moment after the question: a `$` in it waits for the math renderer)

        page.get_by_role("tab", name="Image chat").click()
        page.locator("#image-chat-conversations").get_by_text("What fruit is in the bowl?").click()
        shown = page.locator("#image-chat-image img").first
        shown.wait_for()
        assert "conversation-image-" in shown.get_attribute("src")  # the stored picture, back beside its messages
        page.get_by_text("What fruit is in the bowl?").nth(1).wait_for()
        assert page.locator("#image-chat-history [data-testid=bot]").count() == 1

        with page.expect_download() as download:  # all of them, pictures included, and back in again
            page.locator("#image-chat-export-all-button, button:has-text('Export all')").last.click()
        archive = tmp_path / "all.json"
        download.value.save_as(archive)
        exported = __import__("json").loads(archive.read_text())["conversations"]
        assert sorted(c["tool"] for c in exported) == ["chat", "chat", "image chat"]
        assert next(c for c in exported if c["tool"] == "image chat")["image"] == \
            open("assets/examples/fruit_bowl.jpg", "rb").read().hex()
        with page.expect_file_chooser() as chooser:
            page.get_by_role("button", name="Import conversation").last.click()
        chooser.value.set_files(str(archive))
        page.locator("#image-chat-status").get_by_text("Imported 3 conversations (2 listed in the other tab).") \
            .wait_for()
        page.locator("#image-chat-conversations label").nth(1).wait_for()  # the picture's conversation, twice now


def _sign_in(page, user: str, password: str) -> None:
    page.get_by_label("username").fill(user)
    page.get_by_label("password").fill(password)
    page.get_by_role("button", name="Login").click()
    page.locator("#chat-conversations").wait_for()


def test_two_signed_in_users_never_see_each_others_conversations(browser, tmp_path, studio_cache):
    """With --auth for two users, each in their own browser: neither lists nor finds the other's chats
    (the store's queries name the user; tests/test_store.py forges ids against open, rename and delete)."""
    from conftest import launched

    users = {"alice": "apple-pie", "bob": "banana-split"}
    auth = [arg for user, password in users.items() for arg in ("--auth", f"{user}:{password}")]
    with launched(tmp_path / "auth.log", studio_cache, "--data-dir", str(tmp_path / "data"), "--context", "1024",
                  *auth) as app, browser_page(browser, app.url) as alice, browser_page(browser, app.url) as bob:
        for page, user in ((alice, "alice"), (bob, "bob")):
            _sign_in(page, user, users[user])
            send(page, f"Secret plans of {user} zanzibar")
            page.locator("#chat-status").get_by_text("tok/s").wait_for()
            page.locator("#chat-conversations").get_by_text(f"Secret plans of {user}").wait_for()
        for page, other in ((alice, "bob"), (bob, "alice")):
            page.reload()
            sidebar = page.locator("#chat-conversations")
            sidebar.locator("label").first.wait_for()
            assert sidebar.locator("label").count() == 1 and sidebar.get_by_text(f"of {other}").count() == 0
            page.locator("#chat-search textarea, #chat-search input").first.fill("zanzibar")  # in both users' chats
            page.wait_for_timeout(1000)
            assert sidebar.get_by_text(f"of {other}").count() == 0 and sidebar.locator("label").count() == 1


def test_a_killed_server_keeps_every_completed_message(browser, tmp_path, studio_cache, monkeypatch):
    """SIGKILL while a reply streams: after a restart the finished turn is whole, the question being
    answered is there with the reply as last saved, and SQLite's integrity check passes.

    Its outcome does not hang on the machine's speed: the server is killed as soon as the database holds
    some of the reply's text (polled, not a fixed wait), and that reply cannot end first: greedy without a
    repetition penalty the demo repeats "ieceole" and never says its end token (checked to 32,000 tokens),
    so it runs its whole 4096 tokens, the Max-new-tokens box's ceiling (9 s on a 2-core CPU, where the kill
    comes within a 20 ms poll of its first saved words). Before, a sampled 702-token reply finished in
    1.2 s on a fast CPU, before the 2-second midway save the test waited for. The server writes a reply in
    progress at every update here (STUDIO_SAVE_EVERY_S=0), so its first words are on disk at once."""
    monkeypatch.setenv("STUDIO_SAVE_EVERY_S", "0")
    import signal
    import sqlite3
    import time

    from conftest import launched

    data = tmp_path / "data"

    def reply_saved_midway() -> bool:
        with contextlib.closing(sqlite3.connect(data / "conversations.sqlite3")) as db:
            return db.execute("SELECT COUNT(*) FROM messages WHERE state = 'streaming' AND content != ''"
                              ).fetchone()[0] > 0

    with launched(tmp_path / "killed.log", studio_cache, "--data-dir", str(data), "--context", "8192") as app, \
            browser_page(browser, app.url) as page:
        set_controls(page, seed=23, max_new_tokens=12)
        send(page, "A finished question")
        page.locator("#chat-status").get_by_text("tok/s").wait_for()
        finished = page.locator("#chat-history [data-testid=bot]").last.inner_text().strip()
        set_controls(page, temperature=0, repetition_penalty=1, max_new_tokens=4096)  # no end token: all 4096
        send(page, "An unfinished question")
        page.locator("#chat-status").get_by_text("generating").wait_for()  # the first reply's "tok/s" is gone
        deadline = time.monotonic() + 120
        while not reply_saved_midway():  # the reply's first words on disk: it is running, and saved midway
            status = page.locator("#chat-status").inner_text()
            assert time.monotonic() < deadline and "tok/s" not in status, \
                f"no part of the reply was saved while it ran: {status}"
            time.sleep(0.02)
        app.process.send_signal(signal.SIGKILL)
        app.process.wait(timeout=30)

    with sqlite3.connect(data / "conversations.sqlite3") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = db.execute("SELECT role, content, state FROM messages ORDER BY id").fetchall()
    assert rows[:3] == [("user", "A finished question", "complete"), ("assistant", finished, "complete"),
                        ("user", "An unfinished question", "complete")]
    assert rows[3][0] == "assistant" and rows[3][2] == "streaming" and rows[3][1]  # the reply as last saved

    with launched(tmp_path / "after.log", studio_cache, "--data-dir", str(data)) as app, \
            browser_page(browser, app.url) as page:
        page.locator("#chat-conversations").get_by_text("A finished question").click()
        history = page.locator("#chat-history")
        history.get_by_text("An unfinished question").wait_for()
        assert finished[:20] in history.inner_text()
        history.get_by_text("interrupted: the app stopped before this reply ended").wait_for()  # marked at start


def test_a_damaged_database_is_set_aside_with_a_notice_and_the_app_works(browser, tmp_path, studio_cache):
    from conftest import launched

    data = tmp_path / "data"
    data.mkdir()
    (data / "conversations.sqlite3").write_bytes(b"this is not a database" * 100)
    with launched(tmp_path / "damaged.log", studio_cache, "--data-dir", str(data), "--context", "1024") as app, \
            browser_page(browser, app.url) as page:
        notice = page.locator("#store-notice")
        notice.get_by_text("could not be read").wait_for()
        assert "conversations.damaged-" in notice.inner_text()
        send(page, "Does it still work?")
        page.locator("#chat-status").get_by_text("tok/s").wait_for()
        page.locator("#chat-conversations").get_by_text("Does it still work?").wait_for()
    assert len(list(data.glob("conversations.damaged-*.sqlite3"))) == 1


def _pick(page, elem_id: str, option: str) -> None:
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()


def test_models_tab_switches_the_chat_model_downloads_and_deletes(browser, tmp_path, studio_cache, monkeypatch):
    """Switch chat from demo/qwen-v1-tiny to demo/qwen2-tiny while another session's reply streams: that
    reply finishes on the old model, the other session's banner shows the new one and its next reply
    comes from it (the store records which model answered each). Then a download from a local hub
    (huggingface_hub's client, HF_ENDPOINT): a bad id's one-line message, progress, a connection dropped
    mid-file resumed from the bytes it had, Cancel, and deleting a download after confirming."""
    import shutil
    import sqlite3

    from conftest import launched
    from hub_server import serving

    from pipeline.llm.demo import demo_model_dir

    repo = tmp_path / "repo"
    shutil.copytree(demo_model_dir("demo/qwen2-tiny", studio_cache), repo)
    (repo / "extra.safetensors").write_bytes(os.urandom(24 << 20))  # progress is reported once per 1 MiB read
    data, hub_cache = tmp_path / "data", tmp_path / "hf-cache"
    slow = tmp_path / "slow-repo"  # large enough that Cancel always lands while it downloads
    shutil.copytree(repo, slow)
    (slow / "extra.safetensors").write_bytes(os.urandom(96 << 20))
    repos = {"studio-test/qwen2-tiny": repo, "studio-test/cancelled": slow}
    with serving(repos, delay_s=0.003, drop_once=("extra.safetensors",)) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
        with launched(tmp_path / "models.log", studio_cache, "--data-dir", str(data), "--context", "4096") as app, \
                browser_page(browser, app.url) as admin, browser_page(browser, app.url) as other:
            admin.get_by_role("tab", name="Models").click()
            admin.locator("#models-table span", has_text="demo/qwen2-tiny").first.wait_for()
            _pick(admin, "models-chat", "demo/qwen2-tiny")

            for name, value in (("seed", 38), ("max_new_tokens", 3500), ("temperature", 1.5), ("top_p", 1),
                                ("top_k", 0)):  # seed 38: the demo's reply runs 1,252 tokens
                box = other.locator(f"#chat-{name.replace('_', '-')} input[type=number]")
                box.fill(str(value))
                box.press("Enter")
            send(other, "Tell me a long story")
            other.locator("#chat-status").get_by_text("generating").wait_for()
            admin.get_by_role("button", name="Switch chat").click()
            admin.locator("#models-status").get_by_text("chat now runs demo/qwen2-tiny").wait_for()
            assert "tok/s" not in other.locator("#chat-status").inner_text(), "the reply ended before the switch"
            other.locator("#chat-status").get_by_text("tok/s").wait_for()
            other.locator("#tools-status").get_by_text("demo/qwen2-tiny").wait_for()  # told within its refresh
            other.locator("#chat-max-new-tokens input[type=number]").fill("12")
            other.locator("#chat-max-new-tokens input[type=number]").press("Enter")
            for _ in range(3):  # Gradio drops a submit that comes while the last reply's event is still closing
                send(other, "And now?")
                try:
                    other.locator("#chat-history").get_by_text("And now?").wait_for(timeout=10_000)
                    break
                except sync_api.TimeoutError:
                    continue
            other.locator("#chat-history").get_by_text("And now?").wait_for()
            other.locator("#chat-status").get_by_text("generating").wait_for(state="detached")
            other.locator("#chat-status").get_by_text("tok/s").wait_for()
            with contextlib.closing(sqlite3.connect(data / "conversations.sqlite3")) as db:
                answered = db.execute("SELECT model, state FROM messages WHERE role = 'assistant' ORDER BY id").fetchall()
            assert answered == [("demo/qwen-v1-tiny", "complete"), ("demo/qwen2-tiny", "complete")]

            status, box = admin.locator("#models-status"), admin.locator("#models-download-id textarea, "
                                                                         "#models-download-id input").first
            box.fill("nobody/nothing")
            admin.get_by_role("button", name="Download", exact=True).click()
            admin.get_by_text("there is no model nobody/nothing on the hub").first.wait_for()
            box.fill("studio-test/qwen2-tiny")  # its weights' connection drops halfway, once
            admin.get_by_role("button", name="Download", exact=True).click()
            status.get_by_text("downloaded").wait_for()  # progress shown (bytes, percent, speed)
            status.get_by_text("Downloaded studio-test/qwen2-tiny").wait_for()
            admin.locator("#models-table span", has_text="studio-test/qwen2-tiny").first.wait_for()
            gets = [wanted for name, wanted in hub.ranges if name == "extra.safetensors"]
            assert gets[0] is None and len(gets) == 2 and int(gets[1].removeprefix("bytes=").split("-")[0]) > 0, gets
            blob = next(p for p in (hub_cache / "models--studio-test--qwen2-tiny" / "blobs").iterdir()
                        if p.stat().st_size == 24 << 20)
            assert blob.read_bytes() == (repo / "extra.safetensors").read_bytes()  # resumed, and whole

            box.fill("studio-test/cancelled")
            admin.get_by_role("button", name="Download", exact=True).click()
            status.get_by_text("studio-test/cancelled: downloaded").wait_for()
            admin.get_by_role("button", name="Cancel download").click()
            admin.get_by_text("the download of studio-test/cancelled was cancelled").first.wait_for()

            _pick(admin, "models-delete", "studio-test/qwen2-tiny")
            admin.get_by_role("button", name="Delete…").click()
            status.get_by_text("Delete studio-test/qwen2-tiny").wait_for()  # asked first
            assert (hub_cache / "models--studio-test--qwen2-tiny").exists()
            admin.get_by_role("button", name="Yes, delete its files").click()
            status.get_by_text("Deleted studio-test/qwen2-tiny.").wait_for()
            admin.locator("#models-table span", has_text="studio-test/qwen2-tiny").first.wait_for(state="detached")
            assert not list((hub_cache / "models--studio-test--qwen2-tiny").glob("blobs/*"))


def test_the_default_model_answers_in_the_chat_tab(browser, tmp_path, studio_cache):
    """The app as users start it, with no --model (the real SmolLM2-135M-Instruct), asked a fact in the
    Chat tab at temperature 0 (the UI's default 0.7 samples; greedy gives the same answer every run)."""
    from conftest import launched

    with launched(tmp_path / "default.log", studio_cache, model=None) as app, browser_page(browser, app.url) as page:
        page.locator("#tools-status").get_by_text("smollm2-135m-instruct").first.wait_for()
        box = page.locator("#chat-temperature input[type=number]")
        box.fill("0")
        box.press("Enter")
        send(page, "What is the capital of France?")
        page.locator("#chat-status").get_by_text("tok/s").wait_for()
        assert "Paris" in page.locator("#chat-history [data-testid=bot]").last.inner_text()
