"""The message box during a reply (issue 43), in a real browser: what the user types while a reply streams
stays in the box; Enter then keeps the message there (not sent, not lost) with a line saying why; Send is
off while the box is empty."""

import pytest

from test_browser import ENDLESS, _new_chat, browser, page, set_controls, send, sync_api  # noqa: F401 - fixtures

pytestmark = pytest.mark.browser
expect = sync_api.expect
BOX = "Type a message, Enter to send"


def _user_messages(page) -> list[str]:
    return [t.strip() for t in page.locator("#chat-history [data-testid=user]").all_inner_texts()]


def _bot_length(page) -> int:
    return page.evaluate("() => ([...document.querySelectorAll('#chat-history [data-testid=bot]')].pop()"
                         "?.innerText || '').length")


def test_what_is_typed_during_a_reply_stays_and_enter_waits_with_a_hint(page):
    _new_chat(page)
    set_controls(page, **ENDLESS)
    send(page, "A very long story please")
    page.locator("#chat-status").get_by_text("generating…").wait_for()
    box = page.get_by_placeholder(BOX)
    box.press_sequentially("my next question", delay=30)  # key by key, while updates arrive
    grown = _bot_length(page)
    page.wait_for_function(f"() => ([...document.querySelectorAll('#chat-history [data-testid=bot]')].pop()"
                           f"?.innerText || '').length > {grown}")  # the reply went on streaming after the typing
    assert box.input_value() == "my next question"
    box.press("Enter")  # during the reply: kept in the box, with the reason under it
    expect(page.locator("#chat-hint")).to_contain_text("A reply is still coming")
    page.wait_for_timeout(500)
    assert box.input_value() == "my next question" and _user_messages(page) == ["A very long story please"]
    page.get_by_role("button", name="Stop").first.click()
    page.locator("#chat-status").get_by_text("Stopped").wait_for()
    expect(page.locator("#chat-hint")).to_have_text("")  # the reply ended: nothing waits any more
    assert box.input_value() == "my next question"
    box.press("Enter")
    page.locator("#chat-history [data-testid=user]").get_by_text("my next question").wait_for()
    page.get_by_role("button", name="Stop").first.click()


def test_send_is_off_while_the_box_is_empty(page):
    _new_chat(page)
    box, send_button = page.get_by_placeholder(BOX), page.locator("#chat-send")
    box.fill("")
    expect(send_button).to_be_disabled()
    box.fill("hello")
    expect(send_button).to_be_enabled()
    box.fill("   ")
    expect(send_button).to_be_disabled()
