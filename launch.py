"""Start AI Studio: pick backend, device and model, load, warm up, serve on 127.0.0.1.

    python launch.py chat                  # the terminal chat (same model flags), no browser

    python launch.py                       # auto: a cached 7B on a GPU, else the built-in SmolLM2-135M
    python launch.py --check               # say what would run where, and why, then exit
    python launch.py --model Qwen/Qwen2.5-7B-Instruct --dtype bfloat16
    python launch.py --weights /models/Qwen-7B-Chat --port 8080
    python launch.py --backend onnxruntime    # vision engines built on the first launch, cached after
    python launch.py --build-engines          # build (or check) every engine, then exit
"""

from __future__ import annotations

import sys

STARTING = "[studio] starting: loading torch and the app's libraries…"
SHOWN = __name__ == "__main__" and sys.stderr.isatty()
if SHOWN:  # a line at once: the imports take seconds (the first time, on a cold disk, 15 or more)
    sys.stderr.write(STARTING)
    sys.stderr.flush()

from studio import early_start  # noqa: E402

if __name__ == "__main__":
    early_start.start(sys.argv[1:])

from app.cli import main as terminal_chat  # noqa: E402
from app.port import check_port_free  # noqa: E402
from pipeline.service.tools import Tool  # noqa: E402
from studio.compose import build, run  # noqa: E402
from studio.config import StudioConfig  # noqa: E402
from studio.plan import Plan  # noqa: E402

if SHOWN:  # wiped once they are in: a mistake on the command line stays one line
    sys.stderr.write("\r" + " " * len(STARTING) + "\r")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "chat":  # the terminal chat: same options, no browser
        return terminal_chat(argv[1:])
    return run(argv, start_app)


def start_app(config: StudioConfig, plan: Plan) -> int:
    """Check the port, load the chat tool (every tool with --preload / --build-engines), then serve until
    Ctrl+C."""
    if not config.build_engines:
        check_port_free(config.host, config.port)
    service = build(config, plan)
    for tool in (list(Tool) if config.preload or config.build_engines else [Tool.CHAT]):
        service.load(tool)
    if config.build_engines:
        service.close()
        return 0
    from app.server import serve  # gradio takes seconds to import: the terminal chat starts without it

    return serve(config, service)


if __name__ == "__main__":
    sys.exit(main())
