"""Refresh the screenshots in docs/screenshots/ on the app as a user starts it (the bundled SmolLM2 answers;
Image chat and Segment run their demos where nothing can be downloaded): the first screen wide and on a
phone, a chat with an answer in the system's dark mode, and a phone with its conversation drawer open.
`.venv/bin/python scripts/screenshots.py` (needs Playwright and Debian's chromium, as the tests do)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "screenshots"
WIDE = dict(viewport={"width": 1440, "height": 900})
PHONE = dict(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
QUESTION = "What is the capital of France? Answer in one sentence."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_screen(page: Page) -> None:
    page.wait_for_timeout(1500)  # the header's first refresh


def answered(page: Page) -> None:
    """A question asked and answered (it stays in the store: the phone's drawer lists it after)."""
    box = page.get_by_placeholder("Type a message, Enter to send")
    box.fill(QUESTION)
    box.press("Enter")
    page.locator("#chat-status").get_by_text("tok/s").wait_for(timeout=120_000)
    page.wait_for_timeout(500)


def drawer_open(page: Page) -> None:
    page.get_by_role("button", name="☰ Conversations").first.click()
    page.locator("#chat-conversations").get_by_text(QUESTION[:20]).first.wait_for()
    page.wait_for_timeout(300)


# name → (the browser context's settings, what is done before the shot), in this order
SCREENS: dict[str, tuple[dict, Callable[[Page], None]]] = {
    "first-screen-1440px.png": (WIDE, first_screen),
    "first-screen-390px.png": (PHONE, first_screen),
    "chat-dark-1440px.png": ({**WIDE, "color_scheme": "dark"}, answered),
    "phone-drawer-390px.png": (PHONE, drawer_open),
}


def main() -> int:
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        log = Path(data) / "launch.log"
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
        with open(log, "w") as out:
            app = subprocess.Popen([sys.executable, "launch.py", "--port", str(port), "--no-browser", "--data-dir", data],
                                   cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while "ready: " not in log.read_text():
                if app.poll() is not None or time.time() > deadline:
                    print(log.read_text(), file=sys.stderr)
                    return 1
                time.sleep(0.5)
            OUT.mkdir(parents=True, exist_ok=True)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"])
                for name, (screen, before) in SCREENS.items():
                    context = browser.new_context(**screen)
                    page = context.new_page()
                    page.set_default_timeout(60_000)
                    page.goto(f"http://127.0.0.1:{port}/")
                    page.get_by_text("What can I help with?").wait_for()
                    before(page)
                    page.screenshot(path=str(OUT / name))
                    context.close()
                    print(f"wrote {OUT / name}")
                browser.close()
        finally:
            app.terminate()
            app.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
