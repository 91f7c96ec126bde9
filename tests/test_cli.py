"""The terminal chat, driven over stdin as a user (or a script) types into it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_MODEL

from app.cli import TerminalChat
from pipeline.errors import UserError
from studio.compose import build
from studio.config import parse_config
from studio.plan import make_plan

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = r"prompt (\d+) tokens · "


def test_terminal_chat_two_turns_system_image_reset_and_exit(studio_cache):
    typed = "\n".join(["Hello there", "How are you?", "/system Answer in one word.", "And now?",
                       "/image assets/examples/shapes.jpg", "What is in the picture?", "/reset", "Hi again",
                       "/exit", "never read"]) + "\n"
    env = {**os.environ, "STUDIO_CACHE": str(studio_cache)}
    done = subprocess.run([sys.executable, "launch.py", "chat", "--model", TEST_MODEL, "--context", "2048"], input=typed, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    prompts = [int(n) for n in re.findall(PROMPT_TOKENS, done.stderr)]
    assert len(prompts) == 5, done.stderr[-3000:]  # five replies: two turns, one after /system, image, after /reset
    first, second, after_system, image, after_reset = prompts
    assert second > first + 3  # the second turn carries the first (history)
    assert after_system < second  # /system starts a new conversation
    assert image > 32  # MiniGPT-4's 32 image positions are in the prompt
    assert after_reset < image
    assert "(new conversation)" in done.stdout and "(talking about assets/examples/shapes.jpg" in done.stdout
    assert "never read" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_terminal_chat_explains_a_bad_image_and_carries_on(studio_cache):
    typed = "/image /no/such/file.png\n/image\n/frobnicate\nHello\n"
    env = {**os.environ, "STUDIO_CACHE": str(studio_cache)}
    done = subprocess.run([sys.executable, "-m", "app.cli", "--model", TEST_MODEL, "--context", "2048"], input=typed, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "error: " in done.stderr and "/image needs a path" in done.stderr
    assert "unknown command /frobnicate" in done.stdout
    assert "tok/s" in done.stderr  # the chat still answered
    lines = [line for line in done.stderr.splitlines() if line.startswith("[studio]")]
    assert len(lines) == len(set(lines)), lines  # each start-up line once
    assert not [line for line in lines if "segment" in line or "image chat" in line], lines  # only what it uses


def test_the_terminal_chat_has_its_own_help():
    done = subprocess.run([sys.executable, "launch.py", "chat", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: launch.py chat"), done.stdout[:300]
    for command in ("/reset", "/system TEXT", "/image PATH", "/regenerate", "/edit TEXT", "/set SETTING VALUE", "/help"):
        assert command in done.stdout, command


def test_the_terminal_chats_second_turn_prefills_only_what_is_new(studio_cache):
    """The second turn finds the first in the engine's cache by content. (The Qwen2 demo: Qwen v1's demo
    switches its rotary base past 256 tokens, which a long random first reply can cross, and a prompt
    under another base cannot reuse keys made under the first. Replies are capped at 40 tokens: a long
    random first reply leaves the second prompt no room for the first turn, which is then dropped.)"""
    env = {**os.environ, "STUDIO_CACHE": str(studio_cache)}
    done = subprocess.run([sys.executable, "launch.py", "chat", "--model", "demo/qwen2-tiny", "--context", "1024",
                           "--verbose"],  # the statistics in the engine's terms: the tokens found in its cache
                          input="/set max_new_tokens 40\nHello there\nHow are you?\n/exit\n", cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.findall(r"prompt (\d+) tokens(?: \((\d+) found in the cache\))? · ended", done.stderr)
    assert len(found) == 2, done.stderr[-3000:]
    (first, _), (second, cached) = found
    assert int(second) > int(first) and int(cached or 0) >= int(first)  # the whole first prompt came from the cache


def test_the_terminal_chat_regenerates_and_edits_through_the_services_rules(studio_cache, monkeypatch):
    """/regenerate and /edit are the service's regenerate and edit-last (the browser's own): the turn is
    replaced, never added; a fixed seed draws the same reply again, another seed another; an edited
    message is answered as a fresh conversation would answer it; with nothing to redo, a clear message."""
    monkeypatch.setenv("STUDIO_CACHE", str(studio_cache))
    config = parse_config(["--model", TEST_MODEL, "--context", "1024"])
    service = build(config, make_plan(config), out=None)

    def said(updates) -> str:
        return "".join(update.text for update in updates)

    try:
        chat = TerminalChat(service)
        for line in ("/set seed 7", "/set max_new_tokens 8", "/set temperature 1"):
            chat.command(line)
        with pytest.raises(UserError, match="there is no message of yours"):
            said(chat.command("/regenerate"))
        first = said(chat.reply("Hello there"))
        assert [m["content"] for m in chat.history] == ["Hello there", first] and first
        assert said(chat.command("/regenerate")) == first  # the same seed: the same draw
        assert [m["content"] for m in chat.history] == ["Hello there", first]
        chat.command("/set seed 8")
        other = said(chat.command("/regenerate"))
        assert other != first and [m["content"] for m in chat.history] == ["Hello there", other]
        assert "your last message: 'Hello there'" in chat.command("/edit")
        edited = said(chat.command("/edit How are you?"))
        assert [m["content"] for m in chat.history] == ["How are you?", edited]
        fresh = TerminalChat(service, params=chat.params)
        assert said(fresh.reply("How are you?")) == edited
        assert "/regenerate" in chat.command("/help")
    finally:
        service.close()


JARGON = ("cache rows", "--quant", "instead of TensorRT", "memory budget", "registry")


@pytest.mark.parametrize("verbose", [False, True])
def test_start_up_says_what_runs_where_in_a_users_words(tmp_path, verbose, monkeypatch):
    """One line per tool in plain words, then loading and ready; the details (backends and why, the
    engine's shape, the memory budget) only with --verbose, and always in the page's report. (The hub
    answers here: offline, the image tools' lines say their demos, `test_sam_download`, `test_vlm_download`.)"""
    from pipeline.service.tools import Tool
    from studio import plan

    monkeypatch.setattr(plan, "hub_offline", lambda: "")

    config = parse_config(["--model", TEST_MODEL, "--context", "1024", "--data-dir", str(tmp_path)]
                          + ["--verbose"] * verbose)
    printed: list[str] = []
    service = build(config, make_plan(config), out=printed.append)
    try:
        service.load(Tool.CHAT)
    finally:
        service.close()
    assert printed[:3] == [
        f"Chat: {TEST_MODEL}, a demo with random weights (its replies mean nothing), on the CPU (float32) — for "
        "GPU speed see --help",
        "Image chat: SmolVLM-256M-Instruct, 0.5 GB, downloads on first use, on the CPU (its decoder as 8-bit blocks on "
        "ONNX Runtime)",
        "Segment: MobileSAM, 40 MB, downloads on first use, on the CPU (float32)"]
    assert f"conversations are kept in {tmp_path}" in " ".join(printed) and printed[-1].startswith("chat ready in")
    details = [line for line in service.startup if any(word in line for word in JARGON)]
    assert details  # the page's report keeps them
    assert all(line in printed for line in details) if verbose else not set(details) & set(printed), printed


def test_a_reply_stopped_with_ctrl_c_stays_in_the_terminal_conversation_and_set_reads_plainly(studio_cache,
                                                                                              monkeypatch):
    """Ctrl+C while a reply streams stops it and keeps what it said (as the browser does); /set lists the
    settings as words, not a Python dict."""
    import io

    from app.cli import run

    monkeypatch.setenv("STUDIO_CACHE", str(studio_cache))
    config = parse_config(["--model", TEST_MODEL, "--context", "1024"])
    service = build(config, make_plan(config), out=None)

    class Reader(io.StringIO):  # the terminal: Ctrl+C once the reply has shown some words
        def write(self, text: str) -> int:
            if len(self.getvalue()) > 20 and not interrupted:
                interrupted.append(True)
                raise KeyboardInterrupt
            return super().write(text)

    interrupted: list[bool] = []
    try:
        chat = TerminalChat(service)
        shown = chat.command("/set")
        assert "temperature " in shown and "{" not in shown and "'" not in shown, shown
        chat.command("/set max_new_tokens 400")
        chat.command("/set repetition_penalty 1")
        chat.command("/set seed 0")  # the random demo model's reply runs long (an unseeded one can end in 13 tokens)
        out = Reader()
        assert run(chat, io.StringIO("Tell me a very long story\n"), out) == 0 and interrupted
        assert [m["role"] for m in chat.history] == ["user", "assistant"], chat.history
        kept, shown_text = chat.history[1]["content"], out.getvalue().rstrip("\n")
        assert len(shown_text) > 20 and kept.startswith(shown_text), (kept, shown_text)  # what was seen, kept
    finally:
        service.close()
