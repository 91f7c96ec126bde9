"""Refresh the first-screen screenshots in docs/screenshots/ (a wide screen and a phone), on the demo
models: `.venv/bin/python scripts/screenshots.py` (needs Playwright and Debian's chromium, as the tests do)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "screenshots"
SCREENS = {"first-screen-1440px.png": dict(viewport={"width": 1440, "height": 900}),
           "first-screen-390px.png": dict(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                for name, screen in SCREENS.items():
                    page = browser.new_context(**screen).new_page()
                    page.goto(f"http://127.0.0.1:{port}/")
                    page.get_by_text("What can I help with?").wait_for()
                    page.wait_for_timeout(1500)  # the header's first refresh
                    page.screenshot(path=str(OUT / name))
                    print(f"wrote {OUT / name}")
                browser.close()
        finally:
            app.terminate()
            app.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
