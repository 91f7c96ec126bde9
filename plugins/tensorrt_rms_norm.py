"""The Triton RMSNorm of `plugins.fused` as a TensorRT plugin, `studio::rms_norm`.

Registered through TensorRT's Python plugin API (`tensorrt.plugin`, TensorRT 10.9+), so an exported
network can use the same kernel the torch path runs: in ONNX, a node with op_type `rms_norm`, the
string attribute `plugin_namespace` = "studio" and a float attribute `eps` is imported by TensorRT's
parser as this plugin once `register()` has run in the building process. fp32 and fp16 in and out
(TensorRT's zero-copy tensors refuse bf16, so bf16 networks keep their own normalisation).

Not run here: TensorRT cannot be installed on our machines. The kernel itself is the one
tests/test_gpu.py checks against the reference on the GPU.
"""

from __future__ import annotations

import functools

import torch

from plugins.fused import rms_norm_fused

NAME = "studio::rms_norm"


@functools.cache
def register() -> None:
    """Make `studio::rms_norm` known to TensorRT in this process (once); ImportError without TensorRT."""
    from typing import List, Tuple

    import tensorrt.plugin as trtp

    @trtp.register(NAME)
    def describe(x: trtp.TensorDesc, weight: trtp.TensorDesc, eps: float) -> trtp.TensorDesc:
        return x.like()

    @trtp.autotune(NAME)
    def formats(x: trtp.TensorDesc, weight: trtp.TensorDesc, eps: float,
                outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination("FP32|FP16, FP32|FP16, FP32|FP16")]

    @trtp.impl(NAME)
    def run(x: trtp.Tensor, weight: trtp.Tensor, eps: float, outputs: Tuple[trtp.Tensor], stream: int) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            rms_norm_fused(torch.as_tensor(x, device="cuda"), torch.as_tensor(weight, device="cuda"), eps,
                           out=torch.as_tensor(outputs[0], device="cuda"))
