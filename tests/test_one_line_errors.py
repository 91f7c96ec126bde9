"""Mistakes on the command line end in one line before any wait: a bad flag or value (`error:` and
"see --help", exit 2, not argparse's 22-line usage), a taken port (before the model loads, not a
Gradio traceback after it), and the terminal chat's help lists only its own options."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_MODEL

ROOT = Path(__file__).resolve().parents[1]
SERVER_ONLY = ("--host", "--port", "--share", "--auth", "--api-key", "--no-browser", "--max-upload", "--keep-files",
               "--max-sessions", "--session-idle", "--allow-file-urls", "--preload", "--build-engines")


def launch(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.parametrize("argv, says", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--port", "seven"], "--port: invalid int value: 'seven'"),
    (["--quant", "int3"], "--quant: invalid choice: 'int3'"),
    (["chat", "--share"], "unrecognized arguments: --share"),
])
def test_a_bad_flag_or_value_is_one_error_line_naming_help(argv, says):
    done = launch(*argv)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and says in lines[0] and "--help" in lines[0], lines[0]


@pytest.mark.parametrize("argv, line", [
    (["--sam", "/nonexistent.pth"], "error: /nonexistent.pth does not exist"),
    (["--vlm", "nosuchvlm"], "error: --vlm nosuchvlm: not a folder (it does not exist) nor a hub id like "
                             "HuggingFaceTB/SmolVLM-256M-Instruct (or one of smolvlm, smolvlm-500m, qwen2.5-vl-3b, "
                             "qwen2.5-vl-7b, minigpt4, auto)"),
])
def test_a_model_that_is_not_there_is_one_line_naming_what_is_wrong_before_anything_loads(argv, line):
    done = launch(*argv, "--no-browser", env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    assert (done.stdout + done.stderr).strip().splitlines() == [line]


def test_the_terminal_chats_help_lists_only_its_own_options():
    chat = launch("chat", "--help").stdout
    app = launch("--help").stdout
    for flag in SERVER_ONLY:
        assert f"{flag} " in app or f"{flag}\n" in app, flag
        assert flag not in chat.split("Commands:")[0] + chat.split("options:")[-1], flag
    assert "--model" in chat and "--quant" in chat


def test_a_taken_port_is_one_line_before_the_model_loads(studio_cache):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "STUDIO_CACHE": str(studio_cache)}
        done = launch("--model", TEST_MODEL, "--port", str(port), "--no-browser", env=env)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines == [f"error: port {port} on 127.0.0.1 is taken (another AI Studio, or another server): stop it, "
                     f"or choose a free port with --port {port + 1}"], lines  # nothing loaded before it


def in_terminal(*argv: str) -> tuple[int, str]:
    """`python *argv` in a pseudo-terminal: its exit code and all it wrote, as a terminal receives it."""
    import pty

    out = bytearray()
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, *argv])
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode()


def screen(text: str) -> list[str]:
    """The lines a terminal shows for `text`: within a line, what a carriage return's rewrite leaves."""
    shown = []
    for line in text.split("\r\n"):
        cells: list[str] = []
        for part in line.split("\r"):
            cells = list(part) + cells[len(part):]
        if "".join(cells).strip():
            shown.append("".join(cells).rstrip())
    return shown


def test_a_terminal_sees_a_line_before_torch_loads_and_a_mistake_still_ends_in_one_line():
    """In a terminal the launcher says it is starting before the seconds of imports (`-X importtime` lists each
    import as it ends), and wipes that line once they are in, so the mistake's line is alone on the screen."""
    starting = "[studio] starting: loading torch and the app's libraries…"
    code, text = in_terminal("-X", "importtime", "launch.py", "--sam", "/nonexistent.pth")
    first_torch = re.search(r"\|\s+torch(\.|$)", text, re.M)
    assert code == 2 and starting in text and first_torch and text.index(starting) < first_torch.start(), text[:2000]
    code, text = in_terminal("launch.py", "--sam", "/nonexistent.pth")
    assert code == 2 and starting in text
    assert screen(text) == ["error: /nonexistent.pth does not exist"], text
