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

import argparse
import sys

from app.server import serve
from studio.compose import TOOLS, Plan, build, run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "chat":  # the terminal chat: same options, no browser
        from app.cli import main as terminal_chat

        return terminal_chat(argv[1:])
    return run(argv, start_app)


def start_app(args: argparse.Namespace, plan: Plan) -> int:
    """Load the chat tool (every tool with --preload / --build-engines), then serve until Ctrl+C."""
    service = build(args, plan)
    for name in (TOOLS if args.preload or args.build_engines else ("chat",)):
        service.load(name)
    if args.build_engines:
        service.close()
        return 0
    return serve(args, service)


if __name__ == "__main__":
    sys.exit(main())
