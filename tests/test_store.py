"""The conversation store (SQLite): conversations per user, newest first, titles, full-text search,
images stored once, nothing lost when the process is killed, a damaged file set aside, two processes
on one folder."""

import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from pipeline.errors import UserError
from pipeline.service import store as store_module
from pipeline.service.store import FILE, ConversationStore
from pipeline.service.store_schema import MIGRATIONS, title_from


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path)
    yield s
    s.close()


def test_conversations_are_listed_newest_first_titled_renamed_and_deleted(store):
    first = store.create("ann", "chat")
    store.add("ann", first, "user", "How do   tides work?\nAsk me anything.", "demo/qwen2-tiny", {"temperature": 0.7})
    second = store.create("ann", "chat", title="Recipes")
    store.add("ann", second, "user", "Soup?")
    assert [c["id"] for c in store.list("ann")] == [second, first]
    assert store.list("ann")[1]["title"] == "How do tides work? Ask me anything."  # from the first question
    store.add("ann", first, "assistant", "The moon.", "demo/qwen2-tiny", {"temperature": 0.7})
    assert [c["id"] for c in store.list("ann")] == [first, second]  # the latest message moves it up
    store.rename("ann", first, "  Tides  ")
    opened = store.open("ann", first)
    assert opened["title"] == "Tides"
    assert [(m["role"], m["content"], m["model"], m["sampling"]) for m in opened["messages"]] == [
        ("user", "How do   tides work?\nAsk me anything.", "demo/qwen2-tiny", {"temperature": 0.7}),
        ("assistant", "The moon.", "demo/qwen2-tiny", {"temperature": 0.7})]
    store.delete("ann", second)
    assert [c["id"] for c in store.list("ann")] == [first]
    with pytest.raises(UserError, match="empty"):
        store.rename("ann", first, "   ")
    assert title_from("word " * 40).endswith("…") and len(title_from("word " * 40)) <= 61



def contents(store, c) -> list[str]:
    return [m["content"] for m in store.open("ann", c)["messages"]]


def test_regenerated_replies_and_edited_questions_are_kept_as_versions(store):
    """Regenerate adds a reply beside the old one, Edit a question beside the old one (with its own
    replies); `choose` shows any version's branch; the title follows the first question shown."""
    c = store.create("ann", "chat")
    store.add("ann", c, "user", "First")
    store.add("ann", c, "assistant", "Reply A")
    store.add("ann", c, "user", "Second")
    old = store.add("ann", c, "assistant", "Reply B")
    store.rewind_last_turn("ann", c, keep_question=True)  # regenerate
    new = store.add("ann", c, "assistant", "Reply B2")
    last = store.open("ann", c)["messages"][-1]
    assert contents(store, c) == ["First", "Reply A", "Second", "Reply B2"] and last["versions"] == [old, new]
    store.choose("ann", c, old)
    assert contents(store, c) == ["First", "Reply A", "Second", "Reply B"]
    store.rewind_last_turn("ann", c, keep_question=False)  # edit the last question
    store.add("ann", c, "user", "Second, edited")
    store.add("ann", c, "assistant", "Reply C")
    shown = store.open("ann", c)["messages"]
    assert contents(store, c) == ["First", "Reply A", "Second, edited", "Reply C"] and len(shown[2]["versions"]) == 2
    store.choose("ann", c, shown[2]["versions"][0])  # the old question: its newest reply comes back with it
    assert contents(store, c) == ["First", "Reply A", "Second", "Reply B2"]
    assert store.list("ann")[0]["title"] == "First"
    store.rewind_last_turn("ann", c, keep_question=False)
    store.rewind_last_turn("ann", c, keep_question=False)  # back to the first question: edit it
    store.add("ann", c, "user", "**Better** first")
    assert contents(store, c) == ["**Better** first"] and store.list("ann")[0]["title"] == "Better first"
    store.rename("ann", c, "Mine")
    store.choose("ann", c, store.open("ann", c)["messages"][0]["versions"][0])
    assert store.list("ann")[0]["title"] == "Mine"  # a title the user chose stays
    with pytest.raises(UserError, match="not in conversation"):
        store.choose("ann", c, 10_000)
    with pytest.raises(UserError, match="no conversation"):
        store.choose("bob", c, old)


def test_a_deleted_conversation_can_be_restored_until_it_is_purged(store, monkeypatch):
    c = store.create("ann", "image chat", image=b"photo")
    store.add("ann", c, "user", "What is it?")
    assert store.delete("ann", c) == "What is it?"
    assert store.list("ann") == [] and store.search("ann", "what") == []
    with pytest.raises(UserError, match="no conversation"):
        store.open("ann", c)
    with pytest.raises(UserError, match="cannot be restored"):
        store.restore("bob", c)
    store.restore("ann", c)
    assert contents(store, c) == ["What is it?"]
    store.delete("ann", c)
    now = time.time()
    monkeypatch.setattr(store_module.time, "time", lambda: now + store_module.UNDO_S + 1)
    with pytest.raises(UserError, match="deleted for good"):
        store.restore("ann", c)
    assert store._query("SELECT COUNT(*) FROM messages")[0][0] == 0  # purged, with its messages
    assert store._query("SELECT COUNT(*) FROM images")[0][0] == 0  # and the image nothing else shows


def test_titles_are_plain_text():
    assert title_from("```python\ndef add(a, b):\n    return a + b\n```") == "def add(a, b): return a + b"
    assert title_from("# Why is **the sky** _blue_? See [this](http://x.org)") == "Why is the sky blue? See this"
    assert title_from("keep snake_case and 2*3") == "keep snake_case and 2*3"


def test_a_database_of_the_first_schema_opens_with_every_message_on_one_branch(tmp_path):
    with sqlite3.connect(tmp_path / FILE) as db:
        for statement in MIGRATIONS[0]:
            db.execute(statement)
        db.execute("PRAGMA user_version = 1")
        db.execute("INSERT INTO conversations VALUES (1, 'ann', 'chat', 'Old', NULL, NULL, 0, 0)")
        for i, role in enumerate(["user", "assistant", "user", "assistant"]):
            db.execute("INSERT INTO messages(conversation, role, content, created) VALUES (1, ?, ?, 0)", (role, f"m{i}"))
    store = ConversationStore(tmp_path)
    try:
        assert contents(store, 1) == ["m0", "m1", "m2", "m3"]
        store.rewind_last_turn("ann", 1, keep_question=True)
        store.add("ann", 1, "assistant", "m3 again")
        assert contents(store, 1) == ["m0", "m1", "m2", "m3 again"]
    finally:
        store.close()

def test_search_finds_words_of_old_replies_and_takes_any_text_literally(store):
    a = store.create("ann", "chat")
    store.add("ann", a, "user", "Tell me about volcanoes")
    store.add("ann", a, "assistant", "Magma rises through the crust.")
    b = store.create("ann", "chat")
    store.add("ann", b, "user", "Something else entirely")
    found = store.search("ann", "crust")
    assert [c["id"] for c in found] == [a] and "[crust]" in found[0]["snippet"]
    assert store.search("ann", "MAGMA rises") and not store.search("ann", "magma banana")
    for hostile in ('NEAR("a" OR *', '"', "crust) OR (", "*", "%", "_"):
        store.search("ann", hostile)  # no FTS syntax error reaches the user
    assert store.search("ann", "%") == [] and store.search("ann", "_") == []  # nor LIKE's wildcards


def test_search_matches_titles_whatever_their_case(store):
    a = store.create("ann", "chat")
    store.add("ann", a, "user", "Why are they striped?")
    store.rename("ann", a, "Zebra stripes")
    b = store.create("ann", "chat")
    store.add("ann", b, "user", "A zebra crossing")
    assert [c["id"] for c in store.search("ann", "zebra")] == [b, a]  # a title and a message, newest first
    assert [c["id"] for c in store.search("ann", "STRIPES zeBra")] == [a]
    assert store.search("bob", "zebra") == []


def test_one_user_cannot_see_or_touch_anothers_conversations(store):
    mine = store.create("ann", "chat")
    store.add("ann", mine, "user", "my secret plan")
    assert store.list("bob") == [] and store.search("bob", "secret") == []
    for action in (lambda: store.open("bob", mine), lambda: store.rename("bob", mine, "x"),
                   lambda: store.delete("bob", mine), lambda: store.add("bob", mine, "user", "hi")):
        with pytest.raises(UserError, match="no conversation"):
            action()
    message = store.open("ann", mine)["messages"][0]["id"]
    with pytest.raises(UserError, match="no message"):
        store.update("bob", message, "changed", "complete")
    assert store.open("ann", mine)["messages"][0]["content"] == "my secret plan"


def test_an_image_is_stored_once_and_reopens_with_its_conversation(store, monkeypatch):
    photo = b"\x89PNG fake bytes of a photo"
    a = store.create("ann", "image chat", image=photo)
    b = store.create("ann", "image chat", image=photo)
    with store._lock:
        assert store._db.execute("SELECT COUNT(*) FROM images").fetchone()[0] == 1
    assert store.open("ann", a)["image_data"] == photo and store.list("ann")[0]["has_image"]
    store.delete("ann", a)
    now = time.time()
    monkeypatch.setattr(store_module.time, "time", lambda: now + store_module.UNDO_S + 1)
    store.list("ann")  # a's deletion is final now
    assert store.open("ann", b)["image_data"] == photo  # still shown by b
    store.delete("ann", b)
    monkeypatch.setattr(store_module.time, "time", lambda: now + 2 * store_module.UNDO_S + 2)
    store.list("ann")
    with store._lock:
        assert store._db.execute("SELECT COUNT(*) FROM images").fetchone()[0] == 0


def test_a_stopped_reply_is_saved_as_it_stood(store):
    c = store.create("ann", "chat")
    store.add("ann", c, "user", "Write a long story")
    reply = store.add("ann", c, "assistant", "", "demo", None, "streaming")
    store.update("ann", reply, "Once upon a", "streaming")
    store.update("ann", reply, "Once upon a time", "cancelled")
    last = store.open("ann", c)["messages"][-1]
    assert (last["content"], last["state"]) == ("Once upon a time", "cancelled")


def test_export_and_import_round_trip_every_conversation_with_its_versions(store, tmp_path):
    a = store.create("ann", "image chat", system="Be brief.", image=b"photo")
    store.add("ann", a, "user", "What is this?", "m", {"seed": 1})
    store.add("ann", a, "assistant", "A dog.", "m", {"seed": 1})
    store.rewind_last_turn("ann", a, keep_question=True)
    store.add("ann", a, "assistant", "A cat.", "m", {"seed": 1})
    other = ConversationStore(tmp_path / "other")
    try:
        (new,) = other.import_("bob", store.export("ann", a))
        copy = other.open("bob", new)
        assert (copy["tool"], copy["system"], copy["image_data"]) == ("image chat", "Be brief.", b"photo")
        assert [(m["role"], m["content"], m["sampling"]) for m in copy["messages"]] == [
            ("user", "What is this?", {"seed": 1}), ("assistant", "A cat.", {"seed": 1})]
        assert len(copy["messages"][1]["versions"]) == 2 and copy["title"] == "What is this?"
        for hostile in ([{"role": "user", "content": "x", "parent": 5}], [{"role": "user", "content": "x", "id": [1]}],
                        [{"role": "user", "content": "x", "id": 1, "parent": {}}]):
            with pytest.raises(UserError, match="malformed message"):
                other.import_("bob", [{"tool": "chat", "messages": hostile}])
        with pytest.raises(UserError, match="not one this app exported"):
            other.import_("bob", [{"tool": "email"}])
    finally:
        other.close()


WRITER = """
import sys, time
sys.path.insert(0, {root!r})
from pipeline.service.store import ConversationStore
store = ConversationStore({folder!r})
c = store.create("ann", "chat")
for i in range(100000):
    store.add("ann", c, "user" if i % 2 == 0 else "assistant", f"message {{i}} " + "x" * 200)
    print(i, flush=True)
"""


def test_a_killed_process_loses_no_completed_message(tmp_path):
    """SIGKILL while messages are being written: after reopening, every message the writer had committed
    (it prints each one's number after its commit) is there, and the database passes integrity_check."""
    child = subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT), folder=str(tmp_path))],
                             stdout=subprocess.PIPE, text=True)
    committed = -1
    deadline = time.time() + 60
    while committed < 300 and time.time() < deadline:
        committed = int(child.stdout.readline().split()[0])
    child.kill()
    child.wait()
    with sqlite3.connect(tmp_path / FILE) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store = ConversationStore(tmp_path)
    try:
        (conversation,) = store.list("ann")
        contents = [m["content"] for m in store.open("ann", conversation["id"])["messages"]]
        assert len(contents) >= committed + 1 and all(contents[i].startswith(f"message {i} ") for i in range(300))
        assert store.notice is None
    finally:
        store.close()


def test_a_damaged_database_is_set_aside_and_a_fresh_one_works(tmp_path):
    store = ConversationStore(tmp_path)
    store.add("ann", store.create("ann", "chat"), "user", "hello")
    store.close()
    (tmp_path / FILE).write_bytes(b"this is not a database" * 100)
    store = ConversationStore(tmp_path)
    try:
        assert store.notice and "moved aside" in store.notice and "new, empty one" in store.notice
        assert list(tmp_path.glob("conversations.damaged-*.sqlite3"))
        assert store.list("ann") == []
        store.add("ann", store.create("ann", "chat"), "user", "works again")
        assert store.list("ann")[0]["title"] == "works again"
    finally:
        store.close()


def test_a_database_from_a_newer_app_is_refused_clearly(tmp_path):
    with sqlite3.connect(tmp_path / FILE) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(UserError, match="newer version of the app"):
        ConversationStore(tmp_path)


def test_two_processes_share_one_folder(tmp_path):
    """Two stores (two connections, as two app processes have) write at once: nothing is lost."""
    stores = [ConversationStore(tmp_path), ConversationStore(tmp_path)]
    errors = []

    def write(store, user):
        try:
            c = store.create(user, "chat")
            for i in range(50):
                store.add(user, c, "user", f"{user} {i}")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(s, u)) for s, u in zip(stores, ("ann", "bob"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors
        for user in ("ann", "bob"):
            (c,) = stores[0].list(user)
            assert len(stores[1].open(user, c["id"])["messages"]) == 50
    finally:
        for s in stores:
            s.close()


def test_the_service_saves_each_turn_and_keeps_a_reply_stopped_midway(qwen2_demo, tmp_path):
    """Through the studio service: the question and the finished reply are written with the model and
    sampling that made them; a reply whose reader goes away (a closed tab) is kept as it stood, cancelled."""
    from pipeline.pipelines.chat import ChatPipeline
    from pipeline.service.requests import Saved
    from pipeline.service.studio import StudioService
    from pipeline.service.tools import ToolHost, ToolSpec
    from studio.backends import load_language_model
    import torch

    host = ToolHost(torch.device("cpu"), None, lambda line: None)
    host.add(ToolSpec("chat", lambda say, free: ChatPipeline(load_language_model(qwen2_demo, "demo/qwen2-tiny")), 0))
    service = StudioService(host, store=ConversationStore(tmp_path))
    try:
        conversation = service.store.create("ann", "chat")
        turn = service.chat_turn([{"role": "user", "content": "Hello there"}],
                                 {"max_new_tokens": 12, "temperature": 0, "repetition_penalty": 1.0})
        answer = "".join(u.text for u in service.reply("ui:1", turn, saved=Saved("ann", conversation)))
        endless = service.chat_turn([{"role": "user", "content": "Tell a long story"}],
                                    {"max_new_tokens": 4000, "temperature": 0, "repetition_penalty": 1.0})
        updates = service.reply("ui:1", endless, saved=Saved("ann", conversation))
        partial = "".join(next(u for u in updates if u.text).text for _ in range(1))
        updates.close()  # the reader went away mid-reply
        messages = service.store.open("ann", conversation)["messages"]
        assert [(m["role"], m["state"]) for m in messages] == [("user", "complete"), ("assistant", "complete"),
                                                               ("user", "complete"), ("assistant", "cancelled")]
        assert messages[1]["content"] == answer and answer
        assert messages[1]["model"] == "demo/qwen2-tiny" and messages[1]["sampling"]["max_new_tokens"] == 12
        assert messages[3]["content"].startswith(partial) and len(messages[3]["content"]) < 4000
        assert service.store.list("ann")[0]["title"] == "Hello there"
    finally:
        service.close()
