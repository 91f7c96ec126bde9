"""Weight-only int8 and int4 linear layers for the LLMs (`--quant`).

Why: a decode step reads every weight once per token, so its time is the bytes it reads. int8
halves them and int4 quarters them; a 7B model drops from 15 GB to about 4 GB plus its embeddings.
Activations stay in the model's float dtype (weight-only), which keeps quality close to bf16.

Formats (what the quantized-weight cache stores and the kernels read):
  int8  q int8 [out, in]; scale float32 [out, 1]:     w ≈ q · scale
        symmetric per output channel (the largest |w| of a row maps to 127).
  int4  q uint8 [out, in/2], two values per byte, low nibble first; scale and zero in the model's
        dtype [out, in/group]:                          w ≈ (q − zero) · scale
        asymmetric per group of `group_size(in)` inputs, 32 for a GGUF file's weights (`int4_group`;
        the group's min maps to 0, its max to 15). The
        zero is kept fractional (as HQQ keeps it), so both ends of the range are exact.

Which layers: the four projections of every block (q/k/v, output, gate/up, down) in the mode asked
for, and the LM head in int8 under both modes. The LM head of Qwen2.5-7B is 1.09 GB of bf16, read
every token: at the H100's measured 3 TB/s at least 0.36 ms of a 4.1 ms int8 step, and a fifth of an
int4 step's bytes. int8 per row moves its logits by 0.9 % on Gaussian weights (bf16 rounding alone: 0.17 %; int4
would cost sampling more; llama.cpp's 4-bit files keep their output layer at 6 bits for the same reason).
A head tied to the embedding stays in float with it. The embedding stays in float: a token reads one
row of it.

Kernels: on CUDA, our Triton kernel (`plugins/lowbit.py`: magic-number dequantization into tensor-core
dots, batch 1–16 in one weight pass) reads this format as it is (int8 with its sign bit flipped; int4 in
groups of 128, 64 or a GGUF file's 32, widths padded to whole chunks of 128 inputs), with launch shapes tuned once per
GPU (`plugins/lowbit_tuning.py`). On the CPU, torch's own weight-only kernels (`plugins/cpu_lowbit.py`,
bf16 inside). Where neither can take a layer (a GPU without Triton, widths those kernels refuse) the
reference path dequantizes the weight at each call and runs a plain matmul: the same numbers, the float
layer's speed at best.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plugins import cpu_lowbit, lowbit, lowbit_tuning

MODES = ("none", "int8", "int4")
GROUP = lowbit.GROUP  # int4 group size (TensorRT-LLM's and AWQ's usual choice): 1/32 extra bytes of metadata
QUANTIZED = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")  # per block, the names in model/decoder.py
HEAD_MODE = "int8"  # the LM head's, under both modes (see the module docstring)
BITS = {"int8": 8, "int4": 4}


GGUF_BLOCK = 32  # the weights per block of a GGUF file's 4-bit (and 5-, 6-, 8-bit) encodings


def int4_group(config) -> int:
    """The int4 group a decoder's weights are made in: GROUP; a quantized GGUF file's own blocks of 32,
    which its 4-bit blocks then keep exactly (re-rounding SmolLM2's Q4_1 into groups of 64 cost it 62 %
    perplexity, `bench/RESULTS.md`). The kernels run groups of 32 too (four scales per 64-byte chunk),
    at the price of their extra bytes: 5 bits a weight where groups of 128 take 4.25."""
    return GGUF_BLOCK if config.gguf_type.startswith("Q") else GROUP


def int4_grid(config) -> str:
    """How int4 finds each group's scale and zero: from its smallest and largest value ("minmax", which keeps a
    Q4_1 block exactly: llama.cpp maps its min to 0 and its max to 15), or, for a file whose matrices are all
    Q4_0 ("q4_0"), from the value of largest magnitude, which llama.cpp stores as −8·d: scale d, zero 8. (Min
    and max re-round a Q4_0 block whose values do not reach 7·d: 6.4 % of the weights' norm on Gaussian ones.)"""
    return "q4_0" if tuple(config.gguf_tensor_types) == ("Q4_0",) else "minmax"


def group_size(in_features: int, largest: int = GROUP) -> int:
    """`largest` where it divides the width, else the largest of 64, 32, 16 below it that does: the tiny
    demo models' widths, and SmolLM2's 576 (4.5 groups of 128: groups of 64, padded to whole chunks of 128
    inputs on the kernels, `plugins.lowbit.LowBitWeight.from_parts`)."""
    for size in (largest, 64, 32, 16):
        if size <= largest and in_features % size == 0:
            return size
    raise ValueError(f"int4 needs input widths divisible by 16, got {in_features}")


def pack_int4(q: Tensor) -> Tensor:
    """uint8 values 0..15 [out, in] → [out, in/2], element 2i in the low nibble of byte i."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of `pack_int4`."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def quantize(weight: Tensor, mode: str, dtype: torch.dtype, group: int = GROUP,
             grid: str = "minmax") -> dict[str, Tensor]:
    """`weight` [out, in] in `mode`'s format (see the module docstring; int4 in groups of `group_size(in,
    group)`, each group's scale and zero found as `grid` says: `int4_grid`), computed where the weight is."""
    w = weight.float()
    if mode == "int8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-10)
        return {"q": (w / scale).round().clamp(-127, 127).to(torch.int8), "scale": scale}
    if mode != "int4":
        raise ValueError(f"unknown quantization {mode!r}: use one of {MODES}")
    out, n = w.shape
    size = group_size(n, group)
    groups = w.view(out, n // size, size)
    if grid == "q4_0":  # the value of largest magnitude is −8·d
        largest = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))[..., 0]
        scale = torch.where(largest == 0, 1e-10, -largest / 8).to(dtype)
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = groups.amin(-1), groups.amax(-1)
        # the stored (rounded) scale and zero are the ones the values are computed against
        scale = ((hi - lo) / 15).clamp(min=1e-10).to(dtype)
        zero = (-lo / scale.float()).to(dtype)
    q = (groups / scale.float()[..., None] + zero.float()[..., None]).round().clamp(0, 15).to(torch.uint8)
    return {"q": pack_int4(q.view(out, n)), "scale": scale, "zero": zero}


def dequantize(parts: dict[str, Tensor], mode: str) -> Tensor:
    """The float32 weight [out, in] that `parts` stand for (the reference every kernel must match)."""
    if mode == "int8":
        return parts["q"].float() * parts["scale"].float()
    q = unpack_int4(parts["q"]).float()
    out, n = q.shape
    count = parts["scale"].shape[1]  # the groups (their width follows)
    groups = (q.view(out, count, n // count) - parts["zero"].float()[..., None]) * parts["scale"].float()[..., None]
    return groups.view(out, n)


class QuantLinear(nn.Module):
    """A linear layer whose weight is held quantized; `bias` (Qwen's q/k/v) stays in float.

    Buffers are named `q`, `scale`, `zero` (int4 only) and `bias`, so a state dict of a quantized
    decoder is the cache's file format. `use_kernel` swaps the reference for the Triton low-bit kernel.
    """

    def __init__(self, in_features: int, out_features: int, mode: str, dtype: torch.dtype, bias: bool,
                 group: int = GROUP):
        super().__init__()
        if mode not in BITS:
            raise ValueError(f"unknown quantization {mode!r}")
        self.in_features, self.out_features, self.mode, self.dtype = in_features, out_features, mode, dtype
        self.group = group_size(in_features, group) if mode == "int4" else 0
        if mode == "int8":
            self.register_buffer("q", torch.empty(out_features, in_features, dtype=torch.int8))
            self.register_buffer("scale", torch.empty(out_features, 1, dtype=torch.float32))
        else:
            self.register_buffer("q", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
            groups = in_features // self.group
            self.register_buffer("scale", torch.empty(out_features, groups, dtype=dtype))
            self.register_buffer("zero", torch.empty(out_features, groups, dtype=dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)
        self.kernel: nn.Module | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, device: torch.device | str | None = None,
                    group: int = GROUP, grid: str = "minmax") -> "QuantLinear":
        """Quantize `linear` on `device` (the GPU is fast at it; the layer's own device otherwise), its int4
        groups found as `grid` says (`int4_grid`)."""
        weight = linear.weight.detach()
        dtype = weight.dtype
        with torch.device("meta"):  # every buffer is replaced below
            layer = cls(linear.in_features, linear.out_features, mode, dtype, linear.bias is not None, group)
        parts = quantize(weight.to(device or weight.device), mode, dtype, layer.group or GROUP, grid)
        if linear.bias is not None:
            parts["bias"] = linear.bias.detach().to(parts["q"].device)
        for name, value in parts.items():
            setattr(layer, name, value)
        return layer

    def parts(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in ("q", "scale", "zero") if hasattr(self, name)}

    def weight_float(self) -> Tensor:
        return dequantize(self.parts(), self.mode)

    @property
    def on_cpu_kernels(self) -> bool:
        """Whether this layer's kernel is torch's CPU one: on the CPU, except under Triton's interpreter (with which
        the tests run our GPU kernels there)."""
        return self.q.device.type == "cpu" and not lowbit.INTERPRETED

    def kernel_unavailable(self) -> str | None:
        """None when a low-bit kernel can run this layer where its weights are (int4 in its own groups):
        `plugins.lowbit` on a GPU, torch's own on the CPU (`plugins.cpu_lowbit`); else why not."""
        if self.on_cpu_kernels:
            return cpu_lowbit.available(BITS[self.mode], self.out_features, self.in_features, self.group)
        return lowbit.available(self.q.device, self.dtype, BITS[self.mode], self.in_features, self.group or GROUP)

    def use_kernel(self, workspace: lowbit.Workspace, silu_mul: bool = False) -> None:
        """Repack the weights into the kernel's layout and run the kernel from now on (on the CPU torch's:
        `plugins.cpu_lowbit`); the reference buffers are then freed. `workspace` (one per model) holds
        split-K partial sums. `silu_mul` (a fused gate and up projection, on a GPU): the layer returns
        SiLU(gate)·up, made in the kernel."""
        if self.on_cpu_kernels:
            self.kernel = cpu_lowbit.CPUWeight.int8(self.q, self.scale, self.bias) if self.mode == "int8" else \
                cpu_lowbit.CPUWeight.int4(unpack_int4(self.q), self.scale, self.zero, self.bias)
        else:
            self.kernel = lowbit.LowBitWeight.from_parts(self.parts(), BITS[self.mode], self.dtype, self.bias,
                                                         workspace, gated=silu_mul)
        for name in ("q", "scale", "zero"):
            if hasattr(self, name):
                setattr(self, name, torch.empty(0, device=self.kernel.data.device))

    @property
    def applies_silu_mul(self) -> bool:
        """Whether this layer's output is already SiLU(gate)·up (see `use_kernel`)."""
        return self.kernel is not None and self.kernel.gated

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight_float().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        kernel = "" if self.kernel is None else ", torch CPU kernel" if isinstance(self.kernel, cpu_lowbit.CPUWeight) \
            else ", triton"
        return f"{self.in_features} → {self.out_features}, {self.mode}{kernel}"


def quantized_layers(model: nn.Module, mode: str) -> Iterator[tuple[nn.Module, str, str]]:
    """(parent module, attribute, the layer's mode) of each linear `--quant mode` replaces: every
    block's projections in `mode`, then the LM head in `HEAD_MODE` unless it is the embedding's table."""
    for block in model.layers:
        for path in QUANTIZED:
            parent, name = path.split(".")
            yield getattr(block, parent), name, mode
    if not model.config.tie_word_embeddings:
        yield model, "lm_head", HEAD_MODE


def quantize_decoder(model: nn.Module, mode: str, device: torch.device | str, progress=lambda layers: layers) -> nn.Module:
    """Replace the layers `quantized_layers` names by `QuantLinear`s made on `device`, one at a time, so
    the float weights (on the CPU) never all sit on the GPU at once; `progress` wraps the layer list
    (a progress bar)."""
    group, grid = int4_group(model.config), int4_grid(model.config)
    for parent, name, layer_mode in progress(list(quantized_layers(model, mode))):
        setattr(parent, name, QuantLinear.from_linear(getattr(parent, name), layer_mode, device, group, grid))
    return model


def empty_quantized(model: nn.Module, mode: str) -> nn.Module:
    """Swap a (meta-device) decoder's layers for empty `QuantLinear`s, to load a quantized state dict into."""
    group = int4_group(model.config)
    for parent, name, layer_mode in quantized_layers(model, mode):
        linear = getattr(parent, name)
        setattr(parent, name, QuantLinear(linear.in_features, linear.out_features, layer_mode, linear.weight.dtype,
                                          linear.bias is not None, group))
    return model


def kernel_unavailable(model: nn.Module) -> str | None:
    """None when every `QuantLinear` of `model` can run on the low-bit kernels, else why not."""
    for layer in model.modules():
        if isinstance(layer, QuantLinear) and (why := layer.kernel_unavailable()):
            return f"{why}; the layers dequantize at each call (slow)"
    return None


def use_kernels(model: nn.Module, tuned: lowbit_tuning.TunedConfigs | None = None) -> int:
    """Move every `QuantLinear` of `model` onto the low-bit kernels, with launch shapes from `tuned`
    (tuned now for shapes it lacks, with progress) or the untuned defaults; the number moved. The MLPs'
    gate and up projections apply SiLU·mul in the kernel (`FeedForward` then skips its own)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return 0
    device = layers[0].q.device
    workspace = lowbit.Workspace(device)
    gate_ups = _gate_ups(model)
    for layer in layers:
        layer.use_kernel(workspace, silu_mul=id(layer) in gate_ups)
    if tuned is not None and device.type == "cuda":  # torch's CPU kernels have no launch shapes to tune
        lowbit_tuning.tune_layers([layer.kernel for layer in layers], tuned)
    return len(layers)


def _gate_ups(model: nn.Module) -> set[int]:
    """The ids of the MLPs' fused gate and up projections (their kernels apply SiLU·mul)."""
    return {id(m) for name, m in model.named_modules() if name.endswith("mlp.w_gate_up")}


def kernel_stand_ins(model: nn.Module, device: torch.device) -> list[lowbit.LowBitWeight]:
    """One `LowBitWeight.stand_in` per distinct layer shape that `use_kernels` would make of `model` (a
    meta-device decoder after `empty_quantized`: shapes only) on `device`, so that their kernels compile
    while the weights are read (`lowbit_tuning.compile_ahead`); none where a layer could not run on the
    kernels there."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if any(lowbit.available(device, m.dtype, BITS[m.mode], m.in_features, m.group or GROUP) for m in layers):
        return []
    workspace, gate_ups, shapes = lowbit.Workspace(device), _gate_ups(model), {}
    for m in layers:
        gated = id(m) in gate_ups
        key = (m.mode, m.dtype, m.in_features, m.out_features, m.group, m.bias is not None, gated)
        if key not in shapes:
            shapes[key] = lowbit.LowBitWeight.stand_in(BITS[m.mode], m.dtype, m.in_features, m.out_features,
                                                       m.group, m.bias is not None, device, workspace, gated)
    return list(shapes.values())
