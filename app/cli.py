"""The terminal chat: `python launch.py chat [model flags]` or `python -m app.cli [model flags]`.

The same models, flags, loaders and engines as the app, without a browser: replies stream to
stdout; `/image PATH` talks about a picture (image chat) until `/reset`; start-up and load progress
go to stderr, so stdout holds only the conversation.

Commands: /reset (a new conversation) · /system TEXT (the system prompt; a new conversation) ·
/image PATH · /exit (or end of input). Ctrl+C stops a reply (keeping what was said); at the prompt it exits.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from collections.abc import Iterator

from pipeline.errors import UserError
from pipeline.images import load_image
from pipeline.llm.sampling import SamplingParams
from pipeline.service.studio import StudioService, Update
from studio.compose import build, run as run_studio
from studio.config import StudioConfig
from studio.plan import Plan

HELP = "commands: /reset · /system TEXT · /image PATH · /set SETTING VALUE (e.g. /set temperature 0) · /exit"


class TerminalChat:
    """One conversation's state and the command handling, over the studio service."""

    def __init__(self, service: StudioService, system: str = "You are a helpful assistant.",
                 params: SamplingParams | None = None):
        self.service, self.system, self.params = service, system, params or SamplingParams()
        self.history: list[dict] = []
        self.image = None  # the decoded picture of an image conversation
        self.cancel = threading.Event()

    def reset(self) -> None:
        self.history, self.image = [], None

    def command(self, line: str) -> str | None:
        """Handle a /command; the line to show, or None for /exit."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/exit":
            return None
        if name == "/reset":
            self.reset()
            return "(new conversation)"
        if name == "/system":
            if not arg:
                return f"(system prompt: {self.system!r}; /system TEXT changes it)"
            self.system = arg
            self.reset()
            return "(system prompt set; new conversation)"
        if name == "/image":
            if not arg:
                raise UserError("/image needs a path: /image photo.jpg")
            image = load_image(arg)
            self.reset()
            self.image = image
            return f"(talking about {arg}, {image.shape[1]}×{image.shape[0]}; /reset to go back to plain chat)"
        if name == "/set":
            setting, _, value = arg.partition(" ")
            if not setting:
                return f"(sampling: {dataclasses.asdict(self.params)}; /set SETTING VALUE changes one)"
            try:
                number = json.loads(value.strip())  # as the API's JSON would carry it: 3, 0.7, null
            except ValueError:
                number = value.strip()
            self.params = SamplingParams.from_values(**{**dataclasses.asdict(self.params), setting: number})
            return f"({setting} = {getattr(self.params, setting)})"
        return f"(unknown command {name}; {HELP})"

    def reply(self, message: str) -> Iterator[Update]:
        """Stream the answer to `message`; the turn joins the history once it ends (stopped ones too)."""
        self.cancel = threading.Event()
        turn = self.history + [{"role": "user", "content": message}]
        request = self.service.chat_turn(turn, dataclasses.asdict(self.params), system=self.system, image=self.image)
        answer = ""
        for update in self.service.reply("cli", request, self.cancel):
            answer += update.text
            yield update
        self.history = turn + [{"role": "assistant", "content": answer}]


def _status(line: str) -> None:
    print(f"[studio] {line}", file=sys.stderr, flush=True)


def run(chat: TerminalChat, stdin=sys.stdin, stdout=sys.stdout) -> int:
    """The read–reply loop over `stdin`; returns the exit code."""
    interactive = stdin.isatty()
    print(f"AI Studio terminal chat · {HELP}", file=sys.stderr, flush=True)
    while True:
        if interactive:
            print("\n> ", end="", file=stdout, flush=True)
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            return 0
        if not line:  # end of input
            return 0
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/"):
                said = chat.command(line)
                if said is None:
                    return 0
                print(said, file=stdout, flush=True)
                continue
            try:
                for update in chat.reply(line):
                    if update.notice:
                        print(f"\n[{update.notice}]", file=sys.stderr, flush=True)
                    print(update.text, end="", file=stdout, flush=True)
                    if update.stats is not None:
                        print(f"\n({update.status})", file=sys.stderr, flush=True)
                    elif not update.text and update.status.startswith("Loading"):
                        _status(update.status)
            except KeyboardInterrupt:  # Ctrl+C stops the reply, not the program
                chat.cancel.set()
                print("\n(stopped)", file=sys.stderr, flush=True)
            print(file=stdout, flush=True)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m app.cli` or `python launch.py chat`, with the app's options: the chat tool, then the chat."""
    return run_studio(sys.argv[1:] if argv is None else argv, chat_in_terminal)


def chat_in_terminal(config: StudioConfig, plan: Plan) -> int:
    """Load the chat tool (its progress on stderr), then the terminal chat until /exit or end of input."""
    service = build(config, plan, echo=False, say=_status)
    try:
        service.load("chat", _status)
        return run(TerminalChat(service))
    finally:
        service.close()


if __name__ == "__main__":
    sys.exit(main())
