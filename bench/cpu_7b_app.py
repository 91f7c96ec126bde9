"""A 7B Q4_K_M GGUF chatting through the app on this CPU (issue 50: "the 7B loads and answers on a machine with
16 GB"): a Qwen2.5-7B-shape file (random F16 weights, SmolLM2's vocabulary and chat template so that the app can
tokenize and answer; quantized by llama.cpp's own `llama-quantize`, its Q4_K_M rules) launched as a user launches a
file (`launch.py --model FILE`, a fresh engine cache: the first launch builds its ONNX Runtime engine), asked through
`/v1`, then launched again (the engine mapped from the cache) and asked again. The app's resident memory (its
process tree, psutil) is sampled throughout: the peak of each launch and the size after each reply. The words are
random (random weights): what counts is that a reply comes, and in what memory.

    bash bench/llamacpp.sh build .bench/carry/llama.cpp-src.tar.gz /tmp/llamacpu cpu
    LLAMA_DIR=/tmp/llamacpu python bench/cpu_7b_app.py
Writes cpu_7b_app.json to $OUT (default bench/results); prints a table last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))

from timing import report  # noqa: E402
from user_path import free_port, wait_ready  # noqa: E402

LLAMA = Path(os.environ.get("LLAMA_DIR", "/tmp/llamacpu"))
WORK = Path("/tmp/gguf_bench")
FILE = WORK / "qwen25-7b-shape-vocab-Q4_K_M.gguf"
QUESTION = "Write a short story about a lighthouse keeper."
TOKENS = 16


def make_file() -> Path:
    """The Q4_K_M file, made once: F16 at Qwen2.5-7B's shapes with SmolLM2's vocabulary, then `llama-quantize`."""
    from gguf_native import QWEN25_7B_DIMS, write_model
    from pipeline.models import embedded_gguf

    if not FILE.exists():
        WORK.mkdir(exist_ok=True)
        f16 = WORK / "qwen25-7b-shape-vocab-f16.gguf"
        write_model(f16, 28, c={**QWEN25_7B_DIMS, "vocab": 49152}, device="cpu", vocabulary=embedded_gguf())
        subprocess.run([str(LLAMA / "build/bin/llama-quantize"), str(f16), str(FILE), "Q4_K_M"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        f16.unlink()
    return FILE


def tree_rss(process: psutil.Process) -> int:
    """The resident bytes of `process` and its children."""
    total = 0
    for p in [process, *process.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def launch(file: Path, home: Path) -> dict:
    """One launch of the app on `file`: time to ready, the reply, its speed, peak and after-reply memory."""
    env = {**os.environ, "STUDIO_CACHE": str(home / "cache"), "STUDIO_DATA": str(home / "data"),
           "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    app = subprocess.Popen([sys.executable, "launch.py", "--model", str(file), "--no-browser", "--port",
                            str(free_port())], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace")
    process, peak, done = psutil.Process(app.pid), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(process))
            time.sleep(0.5)

    threading.Thread(target=sample, daemon=True).start()
    lines: list[str] = []
    out: dict = {}  # the peak is added as the app stops
    try:
        url = wait_ready(app, lines)
        if url is None:
            out.update({"failed": f"not ready (exit {app.poll()})", "last lines": lines[-10:]})
            return out
        out["ready s"] = round(time.monotonic() - started, 1)
        api = url.rstrip("/") + "/v1"
        with urllib.request.urlopen(api + "/models", timeout=60) as response:
            model = json.load(response)["data"][0]["id"]
        body = json.dumps({"model": model, "temperature": 0, "max_tokens": TOKENS,
                           "messages": [{"role": "user", "content": QUESTION}]}).encode()
        asked = time.monotonic()
        request = urllib.request.Request(api + "/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1200) as response:
            answer = json.load(response)
        seconds = time.monotonic() - asked
        tokens = answer["usage"]["completion_tokens"]
        out.update({"reply": answer["choices"][0]["message"]["content"], "reply tokens": tokens,
                    "reply s (prompt reading included)": round(seconds, 1),
                    "tok/s (prompt reading included)": round(tokens / seconds, 2),
                    "resident GB after the reply": round(tree_rss(process) / 1e9, 2),
                    "runs as": next((line for line in lines if "ONNX Runtime" in line and "blocks" in line), "")})
        return out
    finally:
        done.set()
        app.send_signal(signal.SIGINT)
        try:
            app.wait(60)
        except subprocess.TimeoutExpired:
            app.kill()
        out["peak resident GB"] = round(peak[0] / 1e9, 2)
        out["peak ÷ file"] = round(peak[0] / file.stat().st_size, 2)


def main() -> None:
    file = make_file()
    res = {"device": f"CPU, {psutil.cpu_count(logical=False)} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB",
           "date": time.strftime("%Y-%m-%d"), "file": file.name, "file GB": round(file.stat().st_size / 1e9, 3)}
    with tempfile.TemporaryDirectory() as home:
        for name in ("first launch (engine built)", "second launch (engine from the cache)"):
            res[name] = launch(file, Path(home))
            report("cpu_7b_app", res)


if __name__ == "__main__":
    main()
