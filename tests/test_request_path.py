"""The request path under `/v1` and the other front ends: a request's `n` choices count against its
client's limit of replies in flight, one failing choice stops the rest, and nothing on the way polls."""

import ast
import threading
import types
from pathlib import Path

import pytest
import torch

from pipeline.errors import UserError
from pipeline.llm.engine.seam import ChatEvent, GenerationStats
from pipeline.service.in_flight import Busy
from pipeline.service.studio import StudioService
from pipeline.service.tools import ToolHost, ToolSpec

ROOT = Path(__file__).resolve().parents[1]


class EndlessChat:
    """A chat pipeline whose replies say "x", then run until their Stop flag is set; a reply seeded
    `failing` fails instead. `ended` counts the replies that have finished."""

    llm = types.SimpleNamespace(model_id="endless", context=0, sampling_defaults={})

    def __init__(self, failing: int | None = None):
        self.failing, self.ended = failing, 0

    def stream(self, messages, params, cancel, session, structure):
        if self.failing is not None and params.seed == self.failing:
            raise UserError("this choice fails", "messages")
        yield ChatEvent(text="x")
        assert cancel.wait(60), "the reply was never stopped"
        self.ended += 1
        yield ChatEvent(stats=GenerationStats(finish_reason="cancelled"))

    def close(self) -> None:
        pass


def service_over(chat: EndlessChat) -> StudioService:
    host = ToolHost(torch.device("cpu"), None, lambda line: None)
    host.add(ToolSpec("chat", lambda say, free: chat, estimate=0))
    host.load("chat")
    return StudioService(host, max_in_flight=4)


def flags(n: int) -> list[threading.Event]:
    return [threading.Event() for _ in range(n)]


def test_n_choices_count_against_their_clients_limit_as_n_replies():
    """Limit 4: while 2 choices of alice's run, 3 more are refused but one reply is not, and then 2 more
    are; an idle client's 5 at once are served, and then it is busy; Stop ends every choice (each one
    of the replies it counts), which frees the slots."""
    service = service_over(EndlessChat())
    turn = service.chat_turn([{"role": "user", "content": "hi"}])
    two = service.choices("alice", turn, flags(2))
    assert next(two)[1].text == "x"
    with pytest.raises(Busy, match="already has 2 replies in progress, and 3 more would pass its limit of 4"):
        next(service.choices("alice", turn, flags(3)))
    five = service.choices("bob", turn, flags(5))
    assert next(five)[1].text == "x"
    with pytest.raises(Busy, match="already has 5 replies in progress"):
        next(service.reply("bob", turn))
    assert service.stop("bob") == 5
    assert sorted(i for i, u in five if u.stats) == [0, 1, 2, 3, 4]
    one = service.reply("alice", turn)
    assert next(one).text == "x"
    with pytest.raises(Busy, match="already has 3 replies in progress"):
        next(service.choices("alice", turn, flags(2)))
    assert service.stop("alice") == 3
    assert [stats.finish_reason for _, u in two if (stats := u.stats)] == ["cancelled"] * 2
    assert [u.stats.finish_reason for u in one if u.stats] == ["cancelled"]
    four = service.choices("alice", turn, flags(4))
    assert next(four)[1].text == "x"
    assert service.stop("alice") == 4
    assert sorted(i for i, u in four if u.stats) == [0, 1, 2, 3]


def test_a_failing_choice_stops_the_others_and_waits_for_them():
    """Choice 1 (seed 7 + 1) fails: the request raises its error once the other choices have ended
    (stopped, not left running), and the client's slots are free again."""
    chat = EndlessChat(failing=8)
    service = service_over(chat)
    turn = service.chat_turn([{"role": "user", "content": "hi"}], {"seed": 7})
    cancels = flags(3)
    with pytest.raises(UserError, match="this choice fails"):
        list(service.choices("alice", turn, cancels))
    assert all(c.is_set() for c in cancels) and chat.ended == 2
    assert service.stop("alice") == 0


POLLING_LIMIT_S = 0.1


def short_waits(path: Path) -> list[str]:
    """Calls in `path` that sleep, or wait with a timeout, for a constant under `POLLING_LIMIT_S`: the
    marks of a polling loop."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        waits = [k.value for k in node.keywords if k.arg == "timeout"]
        if name in ("sleep", "wait"):
            waits += node.args[:1]
        if any(isinstance(w, ast.Constant) and isinstance(w.value, (int, float)) and w.value < POLLING_LIMIT_S
               for w in waits):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_in_the_request_path_polls():
    """No sleep or wait under 0.1 s in the front ends, the service, the pipelines or the LLM code
    (`/v1` is pushed its tokens; `--llm-endpoint` blocks on its stream)."""
    files = [*(ROOT / "app").rglob("*.py"), *(ROOT / "pipeline").rglob("*.py")]
    assert ROOT / "pipeline/llm/remote.py" in files and ROOT / "app/openai_api.py" in files
    assert [line for path in sorted(files) for line in short_waits(path)] == []
