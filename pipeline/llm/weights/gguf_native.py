"""A GGUF file's matrices on the GPU as the file stores them (`--quant gguf`, the default for a quantized GGUF
file there): every projection, the LM head and the embedding keep their blocks (`plugins.gguf_blocks`), and
the kernels dequantize them as they multiply (`plugins.gguf_matmul`), bit for bit gguf-py's values.

Why: a Q4_K_M file is the file LM Studio, Ollama and llama.cpp users have. Made into our int8 it took about
twice its size in GPU memory; re-rounded into our int4 it lost 9 % of perplexity. As stored it takes about
its own size and keeps the file's quality exactly.

One of our fused projections (q/k/v, gate/up) is made of several of the file's matrices, and a mix gives
them different types (Q4_K_M keeps some layers' attn_v in Q6_K): the matrices of one type are joined along
their rows, and each run writes its own columns of the output (`GGUFLinear`). A fused gate and up of one
type returns SiLU(gate)·up from its kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plugins import gguf_matmul
from plugins.gguf_blocks import FORMATS
from plugins.lowbit import Workspace

KINDS = frozenset(FORMATS)  # the types that run as stored


class GGUFLinear(nn.Module):
    """A projection made of runs of output rows, each a `GGUFWeight` (one block type) or a float weight
    (a file's F16/F32 matrix); `bias` (Qwen's q/k/v) in float."""

    def __init__(self, runs: list[gguf_matmul.GGUFWeight | Tensor], bias: Tensor | None, gated: bool = False):
        super().__init__()
        self.runs = runs
        self.register_buffer("bias", bias)
        self.out_features = sum(r.out_features if isinstance(r, gguf_matmul.GGUFWeight) else r.shape[0] for r in runs)
        self.in_features = runs[0].in_features if isinstance(runs[0], gguf_matmul.GGUFWeight) else runs[0].shape[1]
        self.gated = gated  # one run of gate rows above up rows: its kernel returns SiLU(gate)·up

    @classmethod
    def from_matrices(cls, matrices: list[tuple[Tensor, str | None]], in_features: int, bias: Tensor | None,
                      workspace: Workspace, gate_up: bool = False) -> "GGUFLinear":
        """From the file's matrices in output order, each (bytes uint8 [rows, row bytes], its type) or (a float
        weight, None), on the device they are on; consecutive ones of one type are joined."""
        runs: list[gguf_matmul.GGUFWeight | Tensor] = []
        floats = any(kind is None for _, kind in matrices)  # then the bias is added after every run
        start = row = 0
        while start < len(matrices):
            end = start + 1
            while end < len(matrices) and matrices[end][1] == matrices[start][1]:
                end += 1
            kind, joined = matrices[start][1], torch.cat([m for m, _ in matrices[start:end]])
            if kind is None:
                runs.append(joined)
            else:
                run_bias = None if bias is None or floats else bias[row:row + joined.shape[0]].contiguous()
                gated = gate_up and end - start == len(matrices)
                runs.append(gguf_matmul.GGUFWeight.from_raw(joined, kind, in_features, run_bias, workspace, gated))
            start, row = end, row + joined.shape[0]
        gated = isinstance(runs[0], gguf_matmul.GGUFWeight) and runs[0].gated
        return cls(runs, bias if floats else None, gated)

    @property
    def applies_silu_mul(self) -> bool:
        """Whether this layer's output is already SiLU(gate)·up (`FeedForward` then skips its own)."""
        return self.gated

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.runs)  # a GGUFWeight's planes and bias, or a float tensor's bytes

    def forward(self, x: Tensor) -> Tensor:
        if len(self.runs) == 1 and isinstance(self.runs[0], gguf_matmul.GGUFWeight):
            return self.runs[0](x)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        start = 0
        for run in self.runs:
            if isinstance(run, gguf_matmul.GGUFWeight):
                run(rows, out[:, start:start + run.out_features])
                start += run.out_features
            else:
                out[:, start:start + run.shape[0]] = F.linear(rows, run.to(x.dtype))
                start += run.shape[0]
        if self.bias is not None:  # float runs present: the kernels' runs added none
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kinds = [r.kind if isinstance(r, gguf_matmul.GGUFWeight) else "float" for r in self.runs]
        return f"{self.in_features} → {self.out_features}, {' + '.join(kinds)} as stored"


class GGUFEmbedding(nn.Module):
    """An embedding table kept in its blocks: a lookup dequantizes the rows it reads (as gguf-py would)."""

    def __init__(self, table: gguf_matmul.GGUFWeight, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: Tensor) -> Tensor:
        return self.table.dequantize_rows(ids, self.dtype)


def unavailable(device: torch.device, dtype: torch.dtype, kinds: set[str]) -> str | None:
    """None when a file with matrices of `kinds` can run as stored on `device` in `dtype`, else why not."""
    for kind in sorted(kinds):
        if why := gguf_matmul.available(device, dtype, kind):
            return why
    return None
