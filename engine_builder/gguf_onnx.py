"""A GGUF file's decoder as one ONNX graph for ONNX Runtime on the CPU, its matrices low-bit as stored.

Why: on the CPU a decode step in eager torch is hundreds of small operator calls per token, each costing
microseconds of Python and dispatch (SmolLM2-135M: 30 ms a step, most of it not weight streaming), and
torch's weight-only kernels reached 0.20× llama.cpp's decode. One ONNX Runtime session runs the whole step
in native code: `MatMulNBits` for the projections (`pipeline.llm.weights.gguf_nbits`: the file's blocks,
nothing re-rounded, int8 activations where `ACCURACY` says, as llama.cpp's CPU path uses), `GroupQueryAttention`
with RoPE and the KV cache written in place, `SkipSimplifiedLayerNormalization` for each residual add and RMSNorm.
The real SmolLM2 Q4_1 decodes at 0.77–0.83× llama.cpp's speed on this 2-core CPU (0.20× on torch's int4 kernels;
`bench/RESULTS.md`).

The graph (per step; B rows of S tokens each, every row at its own position):
  inputs   embeds [B, S, hidden] (the embedding is looked up outside: a token reads one row of the table),
           seqlens_k int32 [B] (each row's last position), total_len int32 [], wanted int64 [P] (the
           flattened positions whose logits are wanted), cos/sin [positions, head_dim/2] (our rotary tables,
           scaling included), past_key_i / past_value_i [B, kv_heads, positions, head_dim] per layer
  outputs  logits [P, vocab], present_key_i / present_value_i: bound to the past buffers themselves (the
           operator then writes the new keys in place: `pipeline.llm.model.onnx_decoder`)
Weights go to an external data file, each at a 64 KiB boundary, so ONNX Runtime maps them from disk instead
of reading them into memory a second time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import Tensor

from pipeline.llm.weights.config import DecoderConfig
from pipeline.llm.weights.gguf_nbits import NBits, from_gguf

GRAPH, DATA = "decoder.onnx", "decoder.data"
ALIGN = 1 << 16  # each tensor's offset in the data file: mappable on Linux, macOS and Windows
# MatMulNBits' arithmetic per projection: 4 rounds its input to int8 per block (MLAS's fastest path, as
# llama.cpp's CPU dots do), 1 keeps it float32. int8 is kept where the input comes straight from an RMSNorm;
# the attention's output and SiLU(gate)·up carry outliers that int8 blocks flatten (SmolLM2's Q4_1, perplexity
# on assets/eval_text.txt against its float weights' 11.5404: all int8 +2.8 %; int8 for only the down
# projection +0.95 %, only q/k/v −0.02 %, only gate/up +0.22 %, only the head +0.00 %; 2026-11-29, this CPU).
ACCURACY = {"attn.wqkv": 4, "attn.wo": 1, "mlp.w_gate_up": 4, "mlp.w_down": 1, "lm_head": 4}
Matrices = list[tuple[Tensor, str | None]]  # a projection's matrices in output order: (bytes, GGUF type) or (floats, None)


def unsupported(config: DecoderConfig) -> str | None:
    """None when this graph can run `config`'s decoder, else why not (the torch engine runs it then)."""
    if config.dynamic_ntk or config.logn_attn:
        return "Qwen v1's dynamic NTK and logn scaling are not in the ONNX graph"
    if config.mrope_section:
        return "M-RoPE (Qwen2.5-VL's decoder) is not in the ONNX graph"
    return None


class _Writer:
    """The graph's weights, appended to the data file as external initializers."""

    def __init__(self, folder: Path):
        self.file = open(folder / DATA, "wb")
        self.initializers: list[TensorProto] = []
        self.names: set[str] = set()

    def add(self, name: str, value: np.ndarray) -> str:
        if name in self.names:  # a shared constant (the same name, the same value)
            return name
        self.names.add(name)
        value = np.ascontiguousarray(value)
        if value.size < 64:  # small constants stay inside the graph
            self.initializers.append(numpy_helper.from_array(value, name))
            return name
        offset = -(-self.file.tell() // ALIGN) * ALIGN
        self.file.seek(offset)
        self.file.write(value.tobytes())
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(value.dtype), dims=value.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, v in (("location", DATA), ("offset", str(offset)), ("length", str(value.nbytes))):
            tensor.external_data.add(key=key, value=v)
        self.initializers.append(tensor)
        return name


class _Graph:
    """Nodes in the order they run, with fresh names."""

    def __init__(self, writer: _Writer):
        self.nodes: list[onnx.NodeProto] = []
        self.writer = writer
        self._sums: dict[tuple[str, int], str] = {}

    def op(self, kind: str, inputs: list[str], name: str, outputs: int | list[str] = 1, domain: str = "",
           **attrs) -> list[str]:
        """A node; its outputs are `outputs` names, or that many fresh ones."""
        names = outputs if isinstance(outputs, list) else [f"{name}.{i}" if outputs > 1 else name for i in range(outputs)]
        self.nodes.append(helper.make_node(kind, inputs, names, name=name, domain=domain, **attrs))
        return names

    def const(self, name: str, value) -> str:
        return self.writer.add(name, np.asarray(value))

    def block_sums(self, x: str, width: int, block: int) -> str:
        """Each block of `block` inputs of `x` [B, S, width] summed → [B, S, width/block] (once per input): one
        product with a 0/1 matrix, a node fewer than a reshape and a sum."""
        if (x, block) not in self._sums:
            ones = np.kron(np.eye(width // block, dtype=np.float32), np.ones((block, 1), np.float32))
            self._sums[(x, block)] = self.op("MatMul", [x, self.const(f"blocks.{width}.{block}", ones)],
                                             f"{x}.sum{block}")[0]
        return self._sums[(x, block)]

    def linear(self, x: str, width: int, weight: Tensor, kind: str | None, name: str, accuracy: int) -> str:
        """x [.., width] times one of the file's matrices: `MatMulNBits` (+ the offsets' term) for a quantized
        one, a float `MatMul` for an F32/F16/BF16 one."""
        if kind is None:
            return self.op("MatMul", [x, self.const(f"{name}.weight", weight.float().T.contiguous().numpy())], name)[0]
        nb: NBits = from_gguf(weight, kind, width)
        inputs = [x, self.const(f"{name}.q", nb.q), self.const(f"{name}.scales", nb.scales)]
        if nb.zeros is not None:
            inputs.append(self.const(f"{name}.zeros", nb.zeros))
        # 8-bit quants in float32 take ONNX Runtime's unpacked path (the whole matrix dequantized at each call: 1.5 ms
        # where int8 inputs take 29 µs, 3072×576, this CPU): they always take int8 inputs
        out = self.op("MatMulNBits", inputs, name, domain="com.microsoft", K=width, N=nb.shape[0], bits=nb.bits,
                      block_size=nb.block, accuracy_level=accuracy if nb.bits == 4 else 4)[0]
        if nb.offsets is None:
            return out
        sums = self.block_sums(x, width, nb.block)
        offset = self.op("MatMul", [sums, self.const(f"{name}.offsets", nb.offsets)], f"{name}.offset")[0]
        return self.op("Add", [out, offset], f"{name}.total")[0]

    def projection(self, x: str, width: int, matrices: Matrices, bias: Tensor | None, name: str,
                   sizes: list[int]) -> list[str]:
        """A fused projection of ours (q/k/v, gate/up, …) → its parts of `sizes` outputs: one product per run
        of the file's matrices of one type (their rows joined), split where the runs are not those parts."""
        runs = [(torch.cat([m for m, _ in group]), kind) for kind, group in
                ((kind, list(group)) for kind, group in itertools.groupby(matrices, key=lambda mk: mk[1]))]
        accuracy = ACCURACY[name.split(".", 2)[-1] if name.startswith("layers.") else name]
        outs = [self.linear(x, width, m, kind, f"{name}.{i}", accuracy) for i, (m, kind) in enumerate(runs)]
        rows = [m.shape[0] for m, _ in runs]
        if rows != sizes:
            joined = self.op("Concat", outs, f"{name}.joined", axis=-1)[0] if len(outs) > 1 else outs[0]
            split = self.const(f"{name}.sizes", np.array(sizes, np.int64))
            outs = self.op("Split", [joined, split], f"{name}.parts", outputs=len(sizes), axis=-1)
        if bias is not None:
            parts = bias.float().split(sizes)
            outs = [self.op("Add", [o, self.const(f"{name}.bias{i}", b.numpy())], f"{name}.biased{i}")[0]
                    for i, (o, b) in enumerate(zip(outs, parts))]
        return outs

    def head_norm(self, x: str, weight: Tensor, eps: float, heads: int, dim: int, name: str) -> str:
        """Qwen3's q/k norm: RMSNorm over each head's `dim` values of x [B, S, heads·dim]."""
        split = self.op("Reshape", [x, self.const(f"{name}.heads", np.array([0, 0, heads, dim], np.int64))],
                        f"{name}.split")[0]
        normed = self.op("SimplifiedLayerNormalization", [split, self.const(f"{name}.weight", weight.float().numpy())],
                         f"{name}.norm", axis=-1, epsilon=eps)[0]
        return self.op("Reshape", [normed, self.const(f"{name}.width", np.array([0, 0, heads * dim], np.int64))],
                       f"{name}.flat")[0]


def build(folder: Path, config: DecoderConfig, sd: dict, head: tuple[Tensor, str | None],
          progress: Callable[[int, int], None] = lambda done, total: None) -> None:
    """Write `GRAPH` and `DATA` into `folder` for the decoder whose tensors `sd` holds (our names; each block
    projection as f"layers.N.{path}.matrices", a `Matrices` list, and its ".bias"), the LM head's matrix
    `head`; `progress(layers done, layers)` after each layer."""
    c, writer = config, _Writer(folder)
    g = _Graph(writer)
    hidden, eps, f32 = c.hidden_size, c.rms_norm_eps, TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("embeds", f32, ["batch", "tokens", hidden]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_len", TensorProto.INT32, []),
              helper.make_tensor_value_info("wanted", TensorProto.INT64, ["wanted"]),
              helper.make_tensor_value_info("cos", f32, ["positions", c.head_dim // 2]),
              helper.make_tensor_value_info("sin", f32, ["positions", c.head_dim // 2])]
    outputs = [helper.make_tensor_value_info("logits", f32, ["wanted", c.vocab_size])]

    def norm_weight(name: str) -> str:
        return g.const(name, sd.pop(name).float().numpy())

    x = "embeds"
    h = g.op("SimplifiedLayerNormalization", [x, norm_weight("layers.0.attn_norm.weight")], "layers.0.attn_norm",
             axis=-1, epsilon=eps)[0]
    for i in range(c.num_layers):
        p = f"layers.{i}"
        q, k, v = g.projection(h, hidden, sd.pop(f"{p}.attn.wqkv.matrices"), sd.pop(f"{p}.attn.wqkv.bias", None),
                               f"{p}.attn.wqkv", [c.q_size, c.kv_size, c.kv_size])
        if c.qk_norm:
            q = g.head_norm(q, sd.pop(f"{p}.attn.q_norm.weight"), eps, c.num_heads, c.head_dim, f"{p}.attn.q_norm")
            k = g.head_norm(k, sd.pop(f"{p}.attn.k_norm.weight"), eps, c.num_kv_heads, c.head_dim, f"{p}.attn.k_norm")
        cache = [f"past_key_{i}", f"past_value_{i}"]
        inputs += [helper.make_tensor_value_info(n, f32, ["batch", c.num_kv_heads, "positions", c.head_dim]) for n in cache]
        outputs += [helper.make_tensor_value_info(n.replace("past", "present"), f32,
                                                  ["batch", c.num_kv_heads, "positions", c.head_dim]) for n in cache]
        attn = g.op("GroupQueryAttention", [q, k, v, *cache, "seqlens_k", "total_len", "cos", "sin"], f"{p}.attn",
                    outputs=[f"{p}.attn", *(n.replace("past", "present") for n in cache)], domain="com.microsoft",
                    num_heads=c.num_heads, kv_num_heads=c.num_kv_heads, do_rotary=1, rotary_interleaved=0)
        (o,) = g.projection(attn[0], c.q_size, sd.pop(f"{p}.attn.wo.matrices"), sd.pop(f"{p}.attn.wo.bias", None),
                            f"{p}.attn.wo", [hidden])
        h, _, _, x = g.op("SkipSimplifiedLayerNormalization", [o, x, norm_weight(f"{p}.mlp_norm.weight")],
                          f"{p}.mlp_norm", outputs=4, domain="com.microsoft", epsilon=eps)
        gate, up = g.projection(h, hidden, sd.pop(f"{p}.mlp.w_gate_up.matrices"), None, f"{p}.mlp.w_gate_up",
                                [c.intermediate_size] * 2)
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.mlp.sigmoid")[0]], f"{p}.mlp.silu")[0]
        act = g.op("Mul", [silu, up], f"{p}.mlp.act")[0]
        (down,) = g.projection(act, c.intermediate_size, sd.pop(f"{p}.mlp.w_down.matrices"), None, f"{p}.mlp.w_down",
                               [hidden])
        following = f"layers.{i + 1}.attn_norm.weight" if i + 1 < c.num_layers else "norm.weight"
        h, _, _, x = g.op("SkipSimplifiedLayerNormalization", [down, x, norm_weight(following)],
                          following.removesuffix(".weight"), outputs=4, domain="com.microsoft", epsilon=eps)
        progress(i + 1, c.num_layers)
    rows = g.op("Reshape", [h, g.const("rows.shape", np.array([-1, hidden], np.int64))], "rows")[0]
    picked = g.op("Gather", [rows, "wanted"], "picked", axis=0)[0]
    (logits,) = g.projection(picked, hidden, [head], None, "lm_head", [c.vocab_size])
    g.nodes[-1].output[0] = "logits"  # the head's last node writes the graph's output
    writer.file.close()
    graph = helper.make_graph(g.nodes, "decoder", inputs, outputs, writer.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    onnx.save(model, folder / GRAPH)
