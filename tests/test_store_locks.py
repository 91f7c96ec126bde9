"""The conversation database when another program holds it (a backup, the sqlite3 shell left in a
transaction), and after a crash: nothing the user made is moved aside or lost, and a reply is not held up.

The other program is a real second process taking SQLite's locks on the file, told when to let go."""

import subprocess
import sys
import textwrap
import time

import pytest

from pipeline.service import store as store_module
from pipeline.service.messages import INTERRUPTED, plain_messages
from pipeline.service.store import FILE, ConversationStore
from pipeline.service.store_writer import StoreLocked

HOLDER = textwrap.dedent("""
    import sqlite3, sys
    db = sqlite3.connect(sys.argv[1], isolation_level=None)
    if sys.argv[2] == "exclusive":  # nobody else may even read (a writer in exclusive locking mode)
        db.execute("PRAGMA locking_mode=EXCLUSIVE")
        db.execute("BEGIN EXCLUSIVE")
        db.execute("UPDATE conversations SET updated = updated")
    else:  # the write lock, as the sqlite3 shell holds it inside BEGIN IMMEDIATE
        db.execute("BEGIN IMMEDIATE")
    print("locked", flush=True)
    sys.stdin.readline()  # until told to let go
    db.execute("ROLLBACK")
    print("released", flush=True)
""")


class Holder:
    """A second process holding the database's lock until `release`."""

    def __init__(self, path, mode: str):
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), mode], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "locked"

    def holding(self) -> bool:
        return self.process.poll() is None

    def release(self) -> None:
        if self.holding():
            self.process.stdin.write("go\n")
            self.process.stdin.flush()
            assert self.process.stdout.readline().strip() == "released"
            self.process.wait(30)


def a_kept_conversation(folder) -> int:
    store = ConversationStore(folder)
    c = store.create("ann", "chat")
    store.add("ann", c, "user", "Keep me")
    store.close()
    return c


def test_a_write_locked_database_opens_as_it_is(tmp_path):
    """Before, the start-up's migration check waited for the write lock, then took the database for damaged
    and moved it aside: the app started empty."""
    c = a_kept_conversation(tmp_path)
    holder = Holder(tmp_path / FILE, "immediate")
    try:
        store = ConversationStore(tmp_path)
        assert store.notice is None and [m["content"] for m in store.open("ann", c)["messages"]] == ["Keep me"]
        store.close()
    finally:
        holder.release()
    assert sorted(p.name for p in tmp_path.iterdir() if "damaged" in p.name) == []


def test_a_database_locked_against_reading_is_refused_in_one_line_and_never_moved(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 1)
    c = a_kept_conversation(tmp_path)
    holder = Holder(tmp_path / FILE, "exclusive")
    try:
        with pytest.raises(StoreLocked, match="stayed locked by another program for 1 s .* close it, then start"):
            ConversationStore(tmp_path)
    finally:
        holder.release()
    assert [p.name for p in tmp_path.iterdir() if "damaged" in p.name] == []
    store = ConversationStore(tmp_path)
    assert [m["content"] for m in store.open("ann", c)["messages"]] == ["Keep me"]
    store.close()


def wait_until(done, what: str, within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("new_conversation", [False, True])
def test_a_reply_goes_on_while_the_database_is_locked_and_is_saved_once_it_is_released(
        qwen2_demo, tmp_path, monkeypatch, new_conversation):
    """The lock is held from before the message is sent until after its reply ended, longer than the
    busy timeout (made 1 s here; 10 s in the app): before, the reply failed and nothing was saved."""
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 1)
    import torch

    from pipeline.pipelines.chat import ChatPipeline
    from pipeline.service.requests import Saved
    from pipeline.service.studio import StudioService
    from pipeline.service.tools import ToolHost, ToolSpec
    from studio.backends import load_language_model

    host = ToolHost(torch.device("cpu"), None, lambda line: None)
    host.add(ToolSpec("chat", lambda say, free: ChatPipeline(load_language_model(qwen2_demo, "demo/qwen2-tiny")), 0))
    service = StudioService(host, store=ConversationStore(tmp_path))
    kept = None if new_conversation else service.store.create("ann", "chat")
    holder = Holder(tmp_path / FILE, "immediate")
    try:
        updates = list(service.send("ui:1", [], "Hello while locked", {"max_new_tokens": 8, "temperature": 0},
                                    saved=Saved("ann", kept)))
        assert updates[-1].stats is not None or updates[-2].stats is not None  # answered to its end
        answer = "".join(u.text for u in updates)
        assert answer and holder.holding()  # while the other program still held the lock
        assert service.store.writer.pending() > 0 or service.store.writer.waiting_since is not None
        assert [c["title"] for c in service.store.list("ann")] == ([] if new_conversation else [""])
    finally:
        holder.release()
    wait_until(lambda: service.store.writer.pending() == 0 and service.store.writer.waiting_since is None,
               "the queued messages were not written after the lock was released")
    try:
        (listed,) = service.store.list("ann")
        assert listed["title"] == "Hello while locked"
        messages = service.store.open("ann", listed["id"])["messages"]
        assert [(m["role"], m["content"], m["state"]) for m in messages] == [
            ("user", "Hello while locked", "complete"), ("assistant", answer, "complete")]
    finally:
        service.close()


def test_a_reply_cut_by_a_crash_is_marked_interrupted_when_the_store_opens_again(tmp_path):
    store = ConversationStore(tmp_path)
    c = store.create("ann", "chat")
    store.add("ann", c, "user", "Tell me")
    store.add("ann", c, "assistant", "Once upon a", state="streaming")  # then the process died
    store.writer.close(10)
    store._db.close()
    again = ConversationStore(tmp_path)
    try:
        wait_until(lambda: again.writer.pending() == 0, "the start-up's marking was not written")
        from app.sidebar import history_of

        found = again.open("ann", c)
        assert [m["state"] for m in found["messages"]] == ["complete", "interrupted"]
        shown = history_of(found)
        assert shown[-1]["content"] == "Once upon a" + INTERRUPTED
        assert plain_messages(shown)[-1]["content"] == "Once upon a"  # the model never reads the mark
    finally:
        again.close()
