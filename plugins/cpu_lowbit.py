"""Weight-only int4 and int8 matrix products on the CPU, on torch's own kernels (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`): vectorized and multithreaded, shipped in every torch wheel, nothing to compile.

Why: on the CPU a quantized layer dequantized its whole weight at every call (the reference path), so a
GGUF file ran in float32: four bytes a weight streamed per token where its blocks hold about half of one.
torch's kernels read the packed weights and dequantize as they multiply. They compute in bf16: the inputs
are rounded to bf16 on the way in and the outputs come back in the caller's dtype; a group's scale and zero
point are held in bf16 too.

Formats (from `pipeline.llm.weights.quant`'s): int4 `w = (q − zero)·scale` per group becomes torch's
`(q − 8)·scale + (8 − zero)·scale`, the quants repacked once by `_convert_weight_to_int4pack_for_cpu`; int8
`w = q·scale` per output row is torch's format as it is."""

from __future__ import annotations

import torch
from torch import Tensor

MULTIPLE = 16  # output rows (int4) and inputs (both) in multiples of this: torch's int4 packing refuses other
# output widths, and its int8 kernel crashed the process on 2+ rows of 36 or 40 inputs (torch 2.13, x86)
GROUPS = (32, 64, 128, 256)  # the int4 groups its kernel takes
ALIGN = 64  # bytes: its int8 kernel crashed the process on a weight read from a safetensors file at an odd offset
# (a view into the file's buffer); the weights and inputs it reads are fresh, aligned allocations


def available(bits: int, out_features: int, in_features: int, group: int) -> str | None:
    """None when torch's CPU kernels can run such a layer here, else why not."""
    op = "_weight_int4pack_mm_for_cpu" if bits == 4 else "_weight_int8pack_mm"
    if not hasattr(torch.ops.aten, op):
        return f"this torch ({torch.__version__}) has no {op}"
    if in_features % MULTIPLE or (bits == 4 and (out_features % MULTIPLE or group not in GROUPS)):
        return (f"torch's CPU kernels take widths in multiples of {MULTIPLE} (int4: groups of "
                f"{', '.join(map(str, GROUPS))}), not {out_features}×{in_features}" + (f" in groups of {group}"
                                                                                     if bits == 4 else ""))
    return None


class CPUWeight:
    """One layer's weight packed for torch's CPU kernels, with its float bias."""

    gated = False  # SiLU·mul stays the model's own (the kernels return the plain product)

    def __init__(self, bits: int, data: Tensor, scales: Tensor, group: int, bias: Tensor | None):
        self.bits, self.data, self.scales, self.group, self.bias = bits, data, scales, group, bias

    @classmethod
    def int4(cls, q: Tensor, scale: Tensor, zero: Tensor, bias: Tensor | None) -> "CPUWeight":
        """From quants 0–15 [out, in] and each group's scale and zero point [out, groups] (`w = (q − zero)·scale`)."""
        scale, zero = scale.float(), zero.float()
        scales = torch.stack([scale, (8.0 - zero) * scale], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
        data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        return cls(4, data, scales.to(torch.bfloat16), q.shape[1] // scale.shape[1], bias)

    @classmethod
    def int8(cls, q: Tensor, scale: Tensor, bias: Tensor | None) -> "CPUWeight":
        """From int8 quants [out, in] and each output row's scale (`w = q·scale`)."""
        return cls(8, q.clone(memory_format=torch.contiguous_format),
                   scale.reshape(-1).to(torch.bfloat16).clone(memory_format=torch.contiguous_format), 0, bias)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales))

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if rows.data_ptr() % ALIGN or not rows.is_contiguous():
            rows = rows.clone(memory_format=torch.contiguous_format)
        if self.bits == 4:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.data, self.group, self.scales)
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.data, self.scales)
        out = out.to(x.dtype).view(*x.shape[:-1], -1)
        return out + self.bias if self.bias is not None else out
