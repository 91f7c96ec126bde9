"""The CPU decoder of a GGUF file: one ONNX Runtime session (`engine_builder/gguf_onnx.py`) behind `Decoder`'s
forward, so the engine, its scheduler and sampler run it as they run the torch decoder.

The KV cache stays the engine's own (`KVCache`, float32 on the CPU): each layer's rows are bound to the graph's
past and present tensors by address, so `GroupQueryAttention` reads and writes them in place, and a step copies
no keys. A step's parts run as the graph's batches: decode rows (one token each, or a verify step's few) as one
batch of B rows, each prompt read as a batch of one row. The embedding table stays in the file's blocks
(memory-mapped): a step dequantizes the rows of its tokens (gguf-py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import psutil
import torch
from torch import Tensor, nn

from pipeline.llm.model.kv_cache import KVCache
from pipeline.llm.model.parts import ALL, Part, Prefill, Rows
from pipeline.llm.model.rotary import RotaryTables
from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.weights.gguf_quants import dequantize

if TYPE_CHECKING:  # the session is made by `studio/onnx_llm.py`; importing ONNX Runtime here would slow every start
    import onnxruntime as ort

KEPT_TOKENS = 16  # steps of up to this many tokens a row keep their binding (decode and verify shapes)
KEPT_SHAPES = 64  # bindings kept at most


def threads() -> int:
    """The machine's physical cores: the matrix kernels stream memory, and a second thread per core
    (hyper-threading) only competes for the same caches and bandwidth."""
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


class TableEmbedding(nn.Module):
    """An embedding table as the file stores it, [vocab, a row's data] of GGUF type `kind` (memory-mapped): a
    lookup dequantizes the rows it reads (gguf-py)."""

    def __init__(self, table: np.ndarray, kind: str, hidden: int):
        super().__init__()
        self.table, self.kind, self.hidden = table, kind, hidden

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.table[ids.reshape(-1).numpy()]
        return dequantize(rows, self.kind, (len(rows), self.hidden)).reshape(*ids.shape, self.hidden)


class OnnxDecoder(nn.Module):
    """`Decoder.forward` on an ONNX Runtime session of `engine_builder.gguf_onnx`'s graph. `norm` holds the
    final norm's weight, whose device and dtype the engine reads as the model's. `torch_threads`: the engine
    thread's own torch ops (sampling) run on one thread, so that torch's OpenMP workers, spinning after each op,
    do not take the cores from ONNX Runtime's (they halved its speed on 2 cores, 2026-11-29)."""

    torch_threads = 1

    def __init__(self, config: DecoderConfig, session: ort.InferenceSession, embed: nn.Module, norm: Tensor):
        super().__init__()
        self.config, self.session, self.embed = config, session, embed
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(norm.float(), requires_grad=False)
        self._rope: tuple[int, Tensor, Tensor] | None = None  # the tables bound: (id, cos, sin) half-width
        self._batches: dict[tuple, _Batch] = {}

    def forward(self, cache: KVCache, rope: RotaryTables, parts: tuple[Part, ...], tokens: Tensor | None = None,
                embeds: Tensor | None = None, outputs: Tensor | slice | None = ALL) -> Tensor | None:
        x = self.embed(tokens) if embeds is None else embeds.float()
        begin, logits = 0, []
        wanted = torch.arange(x.shape[1]) if isinstance(outputs, slice) else outputs
        for part in parts:
            if isinstance(part, Rows):
                rows, size = part.starts.shape[0], part.per_row
                lengths, start_row = part.starts + size, 0
            elif isinstance(part, Prefill):
                if part.rope is not None or part.offset:
                    raise ValueError("the ONNX decoder has no M-RoPE positions or rotary offsets")
                rows, size = 1, part.size or x.shape[1] - begin
                lengths, start_row = torch.tensor([part.start + size]), part.row
            else:
                raise ValueError("the ONNX decoder reads prompts whole (a `Prefill`), not graphed chunks")
            if isinstance(part, Rows) and bool((part.offsets != 0).any()):
                raise ValueError("the ONNX decoder has one rotary table: no rotary offsets")
            end = begin + rows * size
            mine = wanted[(wanted >= begin) & (wanted < end)] - begin if wanted is not None else torch.tensor([end - begin - 1])
            got = self._run(cache, rope, x[0, begin:end].reshape(rows, size, -1), lengths, start_row, mine)
            if wanted is not None:
                logits.append(got)
            begin = end
        return None if outputs is None else (logits[0] if len(logits) == 1 else torch.cat(logits))[None]

    def _run(self, cache: KVCache, rope: RotaryTables, x: Tensor, lengths: Tensor, start_row: int,
             wanted: Tensor) -> Tensor:
        """One batch: rows start_row.. of the cache, x [B, S, hidden], each row's length after the step → the
        logits of the `wanted` positions, in memory of their own (the bound buffer is the next step's)."""
        key = (id(cache), id(rope), start_row, *x.shape[:2], wanted.shape[0])
        batch = self._batches.get(key)
        if batch is None:
            if self._rope is None or self._rope[0] != id(rope):
                half = self.config.head_dim // 2
                self._rope = (id(rope), rope.cos[:, :half].contiguous(), rope.sin[:, :half].contiguous())
            batch = _Batch(self.session, self.config, cache, (rope, *self._rope[1:]), start_row, *x.shape[:2],
                           wanted.shape[0])
            if x.shape[1] <= KEPT_TOKENS:  # a decode or verify shape: it comes back every step
                if len(self._batches) >= KEPT_SHAPES:
                    self._batches.clear()
                self._batches[key] = batch
        return batch.run(x, lengths, wanted)


class _Batch:
    """One shape of step bound to the session: its input buffers, the rows' KV caches and its logits, bound once
    by address (binding 60-odd tensors anew took a tenth of a small model's step)."""

    def __init__(self, session: ort.InferenceSession, config: DecoderConfig, cache: KVCache,
                 rope: tuple[RotaryTables, Tensor, Tensor], start_row: int, rows: int, size: int, wanted: int):
        self.session, self.binding = session, session.io_binding()
        # held: the binding reads and writes their memory, and their ids (the key) stay theirs while it lives
        self.cache, self.rope = cache, rope
        self.embeds = torch.empty(rows, size, config.hidden_size)
        self.seqlens, self.total = torch.empty(rows, dtype=torch.int32), torch.empty((), dtype=torch.int32)
        self.wanted, self.logits = torch.empty(wanted, dtype=torch.int64), torch.empty(wanted, config.vocab_size)
        for name, value in (("embeds", self.embeds), ("seqlens_k", self.seqlens), ("total_len", self.total),
                            ("wanted", self.wanted), ("cos", rope[1]), ("sin", rope[2])):
            _bind(self.binding.bind_input, name, value)
        for i in range(config.num_layers):
            for kind, table in (("key", cache.k), ("value", cache.v)):
                rows_of_layer = table[i, start_row:start_row + rows]
                _bind(self.binding.bind_input, f"past_{kind}_{i}", rows_of_layer)
                _bind(self.binding.bind_output, f"present_{kind}_{i}", rows_of_layer)
        _bind(self.binding.bind_output, "logits", self.logits)

    def run(self, x: Tensor, lengths: Tensor, wanted: Tensor) -> Tensor:
        self.embeds.copy_(x)
        self.seqlens.copy_(lengths - 1)
        self.total.fill_(int(lengths.max()))
        self.wanted.copy_(wanted)
        self.session.run_with_iobinding(self.binding)
        return self.logits.clone()


def _bind(bind, name: str, value: Tensor) -> None:
    """Bind a CPU tensor's memory (contiguous) to a graph input or output by address: no copy either way."""
    assert value.is_contiguous() and value.device.type == "cpu", name
    dtype = {torch.float32: np.float32, torch.int32: np.int32, torch.int64: np.int64}[value.dtype]
    bind(name, "cpu", 0, dtype, list(value.shape), value.data_ptr())
