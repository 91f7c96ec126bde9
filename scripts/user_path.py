"""The user's first minutes, as CI's first step: the README's first command run as it is on a clean clone
(`bash scripts/start.sh`: a venv of `requirements.txt` and the built-in model only, no test packages, no triton
on a CPU wheel; then the app), then a question a real model answers, asked through `/v1` at temperature 0.
Standard library only (run it with any python3). Prints the time to ready (the install included), the time
to the reply and the reply; exits 1 when any step fails.

    python3 scripts/user_path.py bash scripts/start.sh     # the command; --no-browser --port N are added
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"
EXPECTED = "Paris"
READY_WITHIN_S = 1500  # a fresh install (torch, gradio: minutes on a slow CI machine) and a cold first launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(app: subprocess.Popen, lines: list[str]) -> str | None:
    """The app's URL once it prints its ready line; None if it ends (or stays silent) first."""
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in app.stdout:
            lines.append(line.rstrip())
            print(f"  | {line.rstrip()}", flush=True)
            if "[studio] ready: " in line:
                found.append(line.split("[studio] ready: ", 1)[1].split()[0])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(READY_WITHIN_S)
    return found[0] if found else None


def ask(url: str) -> str:
    """The reply of the first model `/v1/models` lists; an HTTP error's body is said, not a traceback."""
    api = url.rstrip("/") + "/v1"
    try:
        with urllib.request.urlopen(api + "/models", timeout=60) as response:
            model = json.load(response)["data"][0]["id"]
        return _chat(api, model)
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"


def _chat(api: str, model: str) -> str:
    reply, _ = _complete(api, model, QUESTION, 40)
    started = time.monotonic()  # then a longer reply, whose speed the log shows (a figure, never a verdict)
    _, tokens = _complete(api, model, "Write a short story about a lighthouse keeper.", 128)
    print(f"[user path] a {tokens}-token reply took {time.monotonic() - started:.1f} s: "
          f"{tokens / (time.monotonic() - started):.1f} tok/s, prompt reading included", flush=True)
    return reply


def _complete(api: str, model: str, question: str, max_tokens: int) -> tuple[str, int]:
    """One greedy reply through /v1: its text and its number of tokens."""
    body = json.dumps({"model": model, "temperature": 0, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": question}]}).encode()
    request = urllib.request.Request(api + "/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.load(response)
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]


def main(command: list[str]) -> int:
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "STUDIO_CACHE": f"{home}/cache", "STUDIO_DATA": f"{home}/data", "PYTHONUNBUFFERED": "1"}
        started = time.monotonic()
        app = subprocess.Popen([*command, "--no-browser", "--port", str(free_port())], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace")  # pip cuts its progress bars mid-character
        lines: list[str] = []
        try:
            url = wait_ready(app, lines)
            if url is None:
                print(f"[user path] FAILED: the app did not become ready (exit {app.poll()})", flush=True)
                return 1
            ready_s = time.monotonic() - started
            asked = time.monotonic()
            reply = ask(url)
            print(f"[user path] installed and ready in {ready_s:.1f} s; {QUESTION!r} answered in {time.monotonic() - asked:.1f} s: "
                  f"{reply!r}", flush=True)
            if EXPECTED not in reply:
                print(f"[user path] FAILED: the reply does not say {EXPECTED}", flush=True)
                return 1
            return 0
        finally:
            app.send_signal(signal.SIGINT)
            try:
                app.wait(60)
            except subprocess.TimeoutExpired:
                app.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
