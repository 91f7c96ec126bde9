"""The app during a reply, on a long history and on a phone (issue 43), in a real browser: what the user
types while a reply streams stays in the box; Enter then keeps the message there (not sent, not lost) with a
line saying why; Send is off while the box is empty; a new chat is listed while its first reply streams; a
long list scrolls in its own box; on a phone, choosing a conversation folds the list away."""

import json

import pytest

from test_browser import (ENDLESS, _new_chat, browser, browser_page, page, phone_page, set_controls, send,  # noqa: F401
                          sync_api)

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


def test_a_new_chat_is_listed_titled_while_its_first_reply_streams(page):
    _new_chat(page)
    set_controls(page, **ENDLESS)
    send(page, "Tell me about lighthouses")
    page.locator("#chat-status").get_by_text("generating…").wait_for()
    page.locator("#chat-conversations").get_by_text("Tell me about lighthouses").wait_for()
    assert page.locator("#chat-stop").is_visible()  # listed before the reply ended
    page.get_by_role("button", name="Stop").first.click()
    page.locator("#chat-status").get_by_text("Stopped").wait_for()


def _many_conversations(path, n: int = 30) -> None:
    path.write_text(json.dumps({"format": "ai-studio-conversations", "version": 1, "conversations": [
        {"tool": "chat", "title": f"Old talk {i}", "messages": [{"role": "user", "content": f"question {i}"},
                                                                {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(n)]}))


def test_a_long_list_scrolls_in_its_own_box_and_the_actions_stay_in_view(page, tmp_path):
    _many_conversations(tmp_path / "many.json")
    with page.expect_file_chooser() as chooser:
        page.locator("#chat-sidebar").get_by_role("button", name="Import conversation").click()
    chooser.value.set_files(str(tmp_path / "many.json"))
    page.locator("#chat-status").get_by_text("Imported 30 conversations").wait_for()
    listing = page.locator("#chat-conversations")
    for title in ("Old talk 0", "Old talk 29"):  # listed (the list is refreshed after the import's message)
        listing.get_by_text(title, exact=False).first.wait_for(state="attached")
    assert listing.evaluate("e => e.scrollHeight > e.clientHeight")  # more than it shows: it scrolls
    viewport = page.viewport_size["height"]
    rename = page.locator("#chat-sidebar").get_by_role("button", name="Rename").bounding_box()
    assert rename["y"] + rename["height"] <= viewport * 1.2, (rename, viewport)  # not 1,400 px down the page
    assert page.locator("#chat-history").bounding_box()["height"] >= 280  # the pane keeps its height (its floor)


def test_on_a_phone_choosing_a_conversation_folds_the_list_and_shows_the_chat(browser, running_app):  # noqa: F811
    with phone_page(browser, running_app.url) as phone:
        send(phone, "A phone question")
        phone.locator("#chat-status").get_by_text("tok/s").wait_for()
        phone.get_by_role("button", name="☰ Conversations").first.click()
        phone.locator("#chat-sidebar").get_by_role("button", name="New chat").click()  # another one open
        phone.locator("#chat-history").get_by_text("A phone question").wait_for(state="detached")
        phone.locator("#chat-conversations").get_by_text("A phone question").first.scroll_into_view_if_needed()
        phone.evaluate("window.scrollBy(0, 400)")  # down the drawer, as a thumb leaves it
        phone.locator("#chat-conversations").get_by_text("A phone question").first.click()
        expect(phone.locator("#chat-sidebar")).to_be_hidden()
        phone.locator("#chat-history").get_by_text("A phone question").wait_for(state="attached")  # it opened
        phone.wait_for_timeout(500)  # (the fold runs in the page after the list's event)
        top = phone.locator("#chat-history").bounding_box()["y"]
        assert -2 <= top <= 844 / 2, top  # the chat shows at the top of the screen, not 2,500 px down the page


def test_math_renders_and_the_page_follows_dark_mode_with_a_toggle(browser, running_app, tmp_path):  # noqa: F811
    talk = tmp_path / "math.json"
    talk.write_text(json.dumps({"format": "ai-studio-conversation", "version": 1, "messages": [
        {"role": "user", "content": "Some maths?"},
        {"role": "assistant", "content": "Inline $a^2+b^2=c^2$ and \\(e^{i\\pi}\\), then $$\\int_0^1 x\\,dx$$ and "
                                         "\\[\\sum_k k\\]"}]}))
    context = browser.new_context(color_scheme="dark")
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(running_app.url)
        page.get_by_text("What can I help with?").wait_for()
        assert page.evaluate("document.body.classList.contains('dark')")  # the system's dark mode, followed
        page.locator("#theme-toggle").click()
        page.wait_for_function("() => !document.body.classList.contains('dark')")
        page.locator("#theme-toggle").click()
        page.wait_for_function("() => document.body.classList.contains('dark')")
        with page.expect_file_chooser() as chooser:
            page.locator("#chat-sidebar").get_by_role("button", name="Import conversation").click()
        chooser.value.set_files(str(talk))
        page.locator("#chat-history").get_by_text("Some maths?").wait_for()
        bot = page.locator("#chat-history [data-testid=bot]").last
        expect(bot.locator(".katex")).to_have_count(4)  # each of the four delimiters rendered
        assert "$" not in bot.inner_text() and "\\(" not in bot.inner_text()
    finally:
        context.close()


def test_continue_takes_a_reply_cut_at_the_token_limit_on_in_the_same_message(page):
    _new_chat(page)
    set_controls(page, max_new_tokens=8, temperature=0, repetition_penalty=1)
    send(page, "A very long story please")
    page.locator("#chat-status").get_by_text("cut at the token limit").wait_for()
    more = page.locator("#chat-continue")
    expect(more).to_be_visible()
    bots = page.locator("#chat-history [data-testid=bot]")
    count, before = bots.count(), bots.last.inner_text().strip()
    more.click()
    page.wait_for_function(f"() => ([...document.querySelectorAll('#chat-history [data-testid=bot]')].pop()"
                           f"?.innerText || '').trim().length > {len(before)}")
    page.locator("#chat-status").get_by_text("cut at the token limit").wait_for()
    after = bots.last.inner_text().strip()
    assert bots.count() == count and after.startswith(before) and len(after) > len(before)  # the same message grew
    page.reload()  # kept whole: the conversation reopens with the continued reply
    page.locator("#chat-history [data-testid=bot]").last.wait_for()
    page.wait_for_function(f"() => ([...document.querySelectorAll('#chat-history [data-testid=bot]')].pop()"
                           f"?.innerText || '').trim().length >= {len(after)}")
    set_controls(page, max_new_tokens=300)


def test_another_conversation_opens_at_once_during_a_reply_which_goes_on_marked_in_the_list(page):
    _new_chat(page)
    set_controls(page, **ENDLESS)
    send(page, "Tell me about rivers")
    page.locator("#chat-status").get_by_text("generating…").wait_for()
    listing = page.locator("#chat-conversations")
    listing.get_by_text("Tell me about rivers").wait_for()
    page.locator("#chat-sidebar").get_by_role("button", name="New chat").click()  # while the reply streams
    history = page.locator("#chat-history")
    history.get_by_text("Tell me about rivers").wait_for(state="detached")
    page.wait_for_timeout(1500)  # many updates of the reply later: the page still shows the new chat
    assert history.get_by_text("Tell me about rivers").count() == 0
    expect(listing.get_by_text("● Tell me about rivers")).to_be_visible()  # marked: still streaming
    listing.get_by_text("Tell me about rivers").first.click()  # back to it: its reply shows, still growing
    history.get_by_text("Tell me about rivers").wait_for()
    grown = _bot_length(page)
    page.wait_for_function(f"() => ([...document.querySelectorAll('#chat-history [data-testid=bot]')].pop()"
                           f"?.innerText || '').length > {grown}")
    page.get_by_role("button", name="Stop").first.click()
    page.locator("#chat-status").get_by_text("Stopped").wait_for()
    expect(listing.get_by_text("● Tell me about rivers")).to_have_count(0)  # no longer streaming


def _image_chat_question(page, question: str) -> None:
    box = page.get_by_placeholder("Ask about the image, Enter to send")
    box.fill(question)
    box.press("Enter")
    page.locator("#image-chat-status").get_by_text("tok/s").wait_for()


def test_image_chat_continues_a_cut_answer_and_keeps_questions_below_the_panes_icons(browser, running_app):  # noqa: F811
    with browser.new_context(viewport={"width": 1440, "height": 900}) as context:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(running_app.url)
        page.get_by_role("tab", name="Image chat").click()
        for name, value in (("max-new-tokens", 6), ("temperature", 0)):
            page.locator(f"#image-chat-{name} input[type=number]").fill(str(value))
            page.locator(f"#image-chat-{name} input[type=number]").press("Enter")
        page.locator("#image-chat-image input[type=file]").set_input_files("assets/examples/fruit_bowl.jpg")
        _image_chat_question(page, "What fruit is in the bowl?")
        page.locator("#image-chat-status").get_by_text("cut at the token limit").wait_for()
        bots = page.locator("#image-chat-history [data-testid=bot]")
        before = bots.last.inner_text().strip()
        page.locator("#image-chat-continue").click()  # offered: the answer was cut
        page.wait_for_function("() => ([...document.querySelectorAll('#image-chat-history [data-testid=bot]')]"
                               f".pop()?.innerText || '').trim().length > {len(before)}")
        page.locator("#image-chat-status").get_by_text("tok/s").wait_for()
        after = bots.last.inner_text().strip()
        assert bots.count() == 1 and after.startswith(before), (before, after)  # the same message went on

        for question in ("And what is under it? Tell me about the colours, the shapes and the light, at length.",
                         "And the table?"):
            _image_chat_question(page, question)
        page.wait_for_timeout(500)  # the pane scrolls the last question up
        pane = page.evaluate("""() => {
          const pane = document.querySelector('#image-chat-history');
          const box = (el) => el.getBoundingClientRect();
          return {icons: box(pane.querySelector('.top-panel')).bottom, label: box(pane.querySelector('label')).bottom,
                  scroller: box(pane.querySelector('.bubble-wrap')).top,
                  question: box([...pane.querySelectorAll('[data-testid=user]')].pop()).top};
        }""")
        # what scrolls starts below the label and its icons (trash, copy all): no question slides under them
        assert pane["scroller"] >= max(pane["icons"], pane["label"]) and pane["question"] >= pane["icons"], pane


def test_a_screen_reader_hears_done_not_gradios_untranslated_key(browser, running_app):  # noqa: F811
    with browser.new_context() as context:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.add_init_script("""window.said = [];
          new MutationObserver(() => {
            for (const region of document.querySelectorAll('.sr-only[aria-live]'))
              if (region.textContent.trim()) window.said.push(region.textContent.trim());
          }).observe(document, {subtree: true, childList: true, characterData: true});""")
        page.goto(running_app.url)
        send(page, "Hello, screen reader")
        page.locator("#chat-status").get_by_text("tok/s").wait_for()
        page.wait_for_function("() => window.said.includes('Done')")  # (Gradio says it at most every 5 s)
        said = page.evaluate("() => window.said")
        assert not [s for s in said if s.startswith("common.")], said


def test_cancel_download_with_nothing_running_says_so(page):
    page.get_by_role("tab", name="Models").click()
    page.get_by_role("button", name="Cancel download").click()
    page.locator("#models-status").get_by_text("No download is running: there is nothing to cancel.").wait_for()
    page.get_by_role("tab", name="Chat", exact=True).click()


def test_the_header_names_each_tools_model_and_the_engine_terms_wait_in_the_start_up_panel(
        browser, running_app, tmp_path, studio_cache):  # noqa: F811
    """Words for people at the top (the model, its memory); batch, cache rows and chunks in the start-up
    panel's folded details, and in the header too under `--verbose`."""
    from conftest import launched

    engine_terms = ("batch up to", "cache rows", "prefill in chunks")
    with browser_page(browser, running_app.url) as page:
        tools = page.locator("#tools-status")
        tools.get_by_text("demo/qwen-v1-tiny").wait_for()
        assert "of memory" in tools.inner_text() and not [t for t in engine_terms if t in tools.inner_text()]
        page.get_by_text("Start-up: what runs where, and why").click()
        report = page.locator("#startup-report")
        report.get_by_text("Chat:").first.wait_for()  # what runs where, in a user's words, first
        assert not report.get_by_text("cache rows").first.is_visible()
        report.get_by_text("Details: engines, backends and memory").click()
        report.get_by_text("cache rows").first.wait_for()  # how the chat model runs, in the engine's terms
        assert all(t in report.inner_text() for t in engine_terms), report.inner_text()
    with launched(tmp_path / "verbose.log", studio_cache, "--verbose") as app, browser_page(browser, app.url) as page:
        page.locator("#tools-status").get_by_text("cache rows").wait_for()
