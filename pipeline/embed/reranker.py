"""A cross-encoder reranker (ms-marco-MiniLM, bge-reranker): the question and a passage read together as one pair of
texts by a BERT or XLM-RoBERTa encoder, its first token's state through a tanh layer to one relevance score. Slower
than comparing vectors (one pass a passage), so it reorders only the first candidates that retrieval found; it
reads the pair, where vectors compare two texts read apart, so it ranks them better.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from pipeline.embed.bert import BertConfig
from pipeline.embed.embedder import ENCODERS, read_encoder
from pipeline.errors import UserError
from pipeline.weights_io import read_json

# a classifier's architecture → (its tanh layer, its output layer) in the checkpoint
HEADS = {"BertForSequenceClassification": ("bert.pooler.dense", "classifier"),
         "XLMRobertaForSequenceClassification": ("classifier.dense", "classifier.out_proj")}


class Reranker:
    """`score(question, passages)` → one relevance score a passage (higher: more relevant)."""

    def __init__(self, folder: Path, name: str, device: str = "cpu"):
        folder = Path(folder)
        config = read_json(folder / "config.json")
        architecture = (config.get("architectures") or [None])[0]
        labels = len(config.get("id2label") or {"0": "score"})
        if architecture not in HEADS or config.get("model_type") not in ENCODERS or labels != 1:
            raise UserError(f"--reranker {name}: not a cross-encoder with one score ({architecture}); rerankers here "
                            f"are BERT or XLM-RoBERTa sequence classifiers (ms-marco-MiniLM, bge-reranker)")
        self.name, self.device = name, torch.device(device)
        self.config = BertConfig.from_hf(config)
        dense, out = HEADS[architecture]
        self.encoder, head = read_encoder(folder, name, self.config, {
            "dense.weight": f"{dense}.weight", "dense.bias": f"{dense}.bias",
            "out.weight": f"{out}.weight", "out.bias": f"{out}.bias"})
        self.dense, self.out = nn.Linear(1, 1), nn.Linear(1, 1)
        self.dense.weight, self.dense.bias = nn.Parameter(head["dense.weight"]), nn.Parameter(head["dense.bias"])
        self.out.weight, self.out.bias = nn.Parameter(head["out.weight"]), nn.Parameter(head["out.bias"])
        for module in (self.encoder, self.dense, self.out):
            module.to(self.device).eval()
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(min(512, self.config.max_positions - self.config.first_position))

    @torch.inference_mode()
    def score(self, question: str, passages: list[str], batch_size: int = 16) -> np.ndarray:
        encoded = self.tokenizer.encode_batch([(question, passage) for passage in passages])
        out = np.empty(len(encoded), np.float32)
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start:start + batch_size]
            width = max(len(e.ids) for e in chunk)
            ids, mask, segments = (torch.zeros(len(chunk), width, dtype=torch.long) for _ in range(3))
            for row, e in enumerate(chunk):
                ids[row, :len(e.ids)] = torch.tensor(e.ids)
                mask[row, :len(e.ids)] = 1
                segments[row, :len(e.ids)] = torch.tensor(e.type_ids)
            paired = segments.to(self.device) if self.config.type_vocab_size > 1 else None  # XLM-R: one segment
            hidden = self.encoder(ids.to(self.device), mask.to(self.device), paired)
            out[start:start + len(chunk)] = self._head(hidden[:, 0]).float().cpu().numpy()[:, 0]
        return out

    def _head(self, first: Tensor) -> Tensor:
        return self.out(torch.tanh(self.dense(first)))
