"""The generation loop shared by text and image chat: prefill, then one token at a time.

Prefill runs the prompt (token ids, or ready-made embeddings for image chat) through the static KV
cache in one pass. Decoding on CUDA replays a captured CUDA graph per context-length bucket, so a
step costs one launch and attention reads only the filled part of the cache (rounded up to the
bucket), not all of it; on the CPU it runs eagerly.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import torch
from torch import Tensor

from pipeline.cuda_graphs import CapturedCall
from pipeline.llm.model import Decoder
from pipeline.llm.sampling import SamplingParams, next_token

GRAPH_BUCKET = 256  # decode graphs are captured for context lengths rounded up to this


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""  # "stop" | "length" | "context" | "cancelled"

    @property
    def tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0


class Generator:
    """Owns the model's static cache; one generation at a time (the lock), any number of callers."""

    def __init__(self, model: Decoder, max_seq_len: int, use_cuda_graphs: bool | None = None):
        self.model = model
        model.setup_caches(max_seq_len)
        self.max_seq_len = max_seq_len
        self.device = model.embed.weight.device
        self.lock = threading.Lock()
        self.use_cuda_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self._token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self._graphs: dict[int, CapturedCall] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None  # shared by the buckets

    def _decode_step(self, pos: int) -> Tensor:
        """Logits [vocab] for `self._token` placed at position `pos`."""
        self._pos.fill_(pos)
        if not self.use_cuda_graphs:
            return self.model(self._pos, idx=self._token, kv_len=pos + 1)[0, -1]
        kv_len = min(-(-(pos + 1) // GRAPH_BUCKET) * GRAPH_BUCKET, self.max_seq_len)
        if kv_len not in self._graphs:
            self._graphs[kv_len] = CapturedCall(
                lambda token, pos: self.model(pos, idx=token, kv_len=kv_len), self._token, self._pos,
                pool=self._pool)
        return self._graphs[kv_len](self._token, self._pos)[0, -1]

    @torch.inference_mode()
    def stream(self, params: SamplingParams, stop_ids: set[int], prompt_ids: list[int] | None = None,
               prefix_embeds: Tensor | None = None, cancel: threading.Event | None = None,
               stats: GenerationStats | None = None, vocab_size: int | None = None) -> Iterator[int]:
        """Yield new token ids until a stop id, `max_new_tokens`, the context end or `cancel`.

        The prompt is `prompt_ids`, or `prefix_embeds` [1, T, hidden] (image chat splices image
        features into those). `stats` is filled in as generation goes. Only ids below `vocab_size`
        are drawn (embedding tables are padded past the tokenizer's vocabulary).
        """
        stats = stats if stats is not None else GenerationStats()
        with self.lock:
            start = time.perf_counter()
            if prefix_embeds is not None:
                n = prefix_embeds.shape[1]
                prefill = dict(embeds=prefix_embeds.to(self.device, self.model.embed.weight.dtype))
            else:
                n = len(prompt_ids)
                prefill = dict(idx=torch.tensor([prompt_ids], dtype=torch.long, device=self.device))
            if not 0 < n < self.max_seq_len:
                raise ValueError(f"prompt of {n} tokens does not fit a context of {self.max_seq_len}")
            stats.prompt_tokens = n
            self.model.prepare_context(n)
            vocab = slice(0, vocab_size)
            logits = self.model(torch.arange(n, device=self.device), kv_len=n, last_only=True, **prefill)[0, -1, vocab]
            seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=self.device)
            if prompt_ids is not None:
                seen[torch.tensor(prompt_ids, device=self.device)] = True
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else torch.seed())
            stats.finish_reason = "length"
            for i in range(params.max_new_tokens):
                if cancel is not None and cancel.is_set():
                    stats.finish_reason = "cancelled"
                    break
                token = next_token(logits, params, seen, generator)
                token_id = int(token)
                now = time.perf_counter()
                if i == 0:
                    stats.time_to_first_token_s, decode_start = now - start, now
                else:
                    stats.decode_s = now - decode_start
                if token_id in stop_ids:
                    stats.finish_reason = "stop"
                    break
                stats.new_tokens += 1
                yield token_id
                if i + 1 == params.max_new_tokens:
                    break
                pos = n + i
                if pos + 1 >= self.max_seq_len:
                    stats.finish_reason = "context"
                    break
                seen[token] = True
                self._token.copy_(token.view(1, 1))
                logits = self._decode_step(pos)[vocab]
