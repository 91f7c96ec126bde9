"""Low-bit weights on the CPU (`plugins/cpu_lowbit.py`, torch's own kernels): a quantized layer there runs on them
with the numbers of its dequantized weights within bf16's rounding (the kernels compute in bf16), in int4 (each
group size they take) and int8, with a bias, for one row and several, from inputs that are views at odd offsets;
and a layer they cannot take says why and keeps the reference path."""

import pytest
import torch

from plugins import cpu_lowbit
from pipeline.llm.weights.quant import QuantLinear


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode,group", [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 128)])
def test_a_quantized_layer_runs_on_torchs_cpu_kernels_with_its_weights_numbers(mode, group):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    layer = QuantLinear.from_linear(linear, mode, group=group)
    weight, bias = layer.weight_float(), linear.bias.detach()
    assert layer.kernel_unavailable() is None
    layer.use_kernel(None)
    assert isinstance(layer.kernel, cpu_lowbit.CPUWeight) and "torch CPU kernel" in repr(layer)
    wide = torch.randn(5, 257)
    for x in (wide[:1, 1:], wide[:, 1:], wide[:, 1:].reshape(5, 1, 256)):  # odd offsets, 1 row, 5, 3-D
        want = x @ weight.T + bias
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert rel(got, want) < 6e-3, (mode, group, rel(got, want))  # bf16 inputs and outputs


def test_a_layer_the_kernels_cannot_take_keeps_the_reference_path_and_says_why():
    assert "multiples of 16" in cpu_lowbit.available(8, 64, 40, 0)  # 36 or 40 inputs crashed its int8 kernel
    assert "groups of 32, 64, 128, 256" in cpu_lowbit.available(4, 64, 64, 16)
    assert "not 40×64" in cpu_lowbit.available(4, 40, 64, 32)
    layer = QuantLinear.from_linear(torch.nn.Linear(48, 40), "int4", group=16)
    assert layer.kernel_unavailable() is not None
    x = torch.randn(2, 48)
    assert rel(layer(x), x @ layer.weight_float().T + layer.bias) < 1e-5  # the reference: dequantized per call
