"""Which pre-quantized checkpoints run here: a `quantization_config` read and checked, nothing loaded.

A leaf of its own because the config reader (`config.py`) must refuse an unsupported scheme by name
while the repacking (`prequantized.py`) reads configs through that reader.
"""

from __future__ import annotations

import dataclasses

from pipeline.errors import UserError
from pipeline.llm.weights.quant import GROUP

GPTQ_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format → what a stored zero lacks


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A `quantization_config` this app runs."""

    method: str  # "awq" or "gptq"
    zero_offset: int = 0  # added to each stored zero (GPTQ v1 stores zero − 1)
    desc_act: bool = False  # GPTQ act-order: runs only where every g_idx turns out to be in order


def _refused(setting: str, why: str) -> UserError:
    return UserError(f"config.json's quantization_config has {setting}, which this app cannot run: {why}")


def scheme_of(qc: dict) -> Scheme:
    """Validate a `quantization_config`: AWQ (GEMM) or GPTQ, 4 bits in groups of GROUP inputs; anything
    else is refused, naming the setting and what to take instead."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise _refused(f"quant_method {method!r}", "it loads AWQ and GPTQ int4 checkpoints; use the model's float "
                                                   "checkpoint with --quant int8 or int4")
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise _refused(f"bits {bits}", "only 4-bit AWQ/GPTQ checkpoints load; take the model's Int4 variant, or "
                                       "its float checkpoint with --quant int8")
    if group != GROUP:
        raise _refused(f"group_size {group}", f"the int4 kernels here run groups of {GROUP} inputs; take a "
                                              f"variant quantized with group_size {GROUP}, or the float checkpoint "
                                              f"with --quant int4")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refused(f"AWQ version {version!r}", "only GEMM-packed AWQ checkpoints load; take a GEMM variant")
        if not qc.get("zero_point", True):
            raise _refused("AWQ zero_point false", "only AWQ checkpoints with zero points load")
        return Scheme("awq")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in GPTQ_ZERO_OFFSET:
        raise _refused(f"GPTQ checkpoint_format {fmt!r}", f"it loads {' and '.join(GPTQ_ZERO_OFFSET)} ones")
    return Scheme("gptq", GPTQ_ZERO_OFFSET[fmt], bool(qc.get("desc_act", False)))
