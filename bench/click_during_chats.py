"""A segmentation click while chats generate, end to end through the app's API (`gradio_client`).

Starts `launch.py` (demo models unless flags say otherwise), measures `/segment` on a cached image
alone, then while 4 sessions stream long replies, and the chat engine's decode-step time over the
same window (from `/engine_status`). The claim checked: a click waits at most about one decode
step behind the chats, not for their replies. Prints a table; writes click_during_chats.json.

    python bench/click_during_chats.py [launch.py flags…]
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradio_client import Client, handle_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENDLESS = ("Write a very long story", [], "You are a helpful assistant.", 0.0, 0.8, 20, 1.0, 4000, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def click_ms(client: Client, photo, n: int = 15) -> tuple[list[float], list[float]]:
    """Round-trip times of `n` clicks (upload, decode, mask PNG, download) and the server's own
    SAM decoder times for them."""
    times, decoder = [], []
    for i in range(n):
        start = time.perf_counter()
        _, info = client.predict(photo, f"[[{100 + 20 * i}, 300, 1]]", "", True, api_name="/segment")
        times.append((time.perf_counter() - start) * 1e3)
        decoder.append(json.loads(info)["decoder_ms"])
    return times, decoder


def main() -> None:
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "launch.log"
    with open(log, "w") as out:
        app = subprocess.Popen([sys.executable, "launch.py", "--port", str(port), "--context", "4096", *sys.argv[1:]],
                               cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        while f"127.0.0.1:{port}" not in log.read_text():
            if app.poll() is not None:
                raise SystemExit(log.read_text())
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}/"
        client = Client(url, verbose=False)
        photo = handle_file(str(ROOT / "assets/examples/street.jpg"))
        click_ms(client, photo, 3)  # encodes the image, warms up
        alone, decoder_alone = click_ms(client, photo)
        chatters = [Client(url, verbose=False) for _ in range(4)]
        jobs = [c.submit(*ENDLESS, api_name="/chat") for c in chatters]
        status = lambda: json.loads(client.predict(api_name="/engine_status"))["chat"]  # noqa: E731
        while status()["running"] < 4:
            time.sleep(0.05)
        steps0, t0 = status()["decode_steps"], time.perf_counter()
        during, decoder_during = click_ms(client, photo)
        after = status()
        step_ms = (time.perf_counter() - t0) * 1e3 / max(after["decode_steps"] - steps0, 1)
        still_running = after["running"]
        for c in chatters:
            c.predict(api_name="/stop")
        for job in jobs:
            job.result(timeout=60)
    finally:
        app.terminate()
        app.wait(timeout=30)
    res = {"click_alone_ms": round(statistics.median(alone), 1), "click_during_4_chats_ms": round(statistics.median(during), 1),
           "sam_decoder_alone_ms": round(statistics.median(decoder_alone), 2),
           "sam_decoder_during_4_chats_ms": round(statistics.median(decoder_during), 2),
           "decode_step_ms_with_4_chats": round(step_ms, 2), "chats_still_running_after_clicks": still_running,
           "date": time.strftime("%Y-%m-%d"), "args": sys.argv[1:]}
    res["extra_delay_ms"] = round(res["click_during_4_chats_ms"] - res["click_alone_ms"], 1)
    report("click_during_chats", res)


if __name__ == "__main__":
    main()
