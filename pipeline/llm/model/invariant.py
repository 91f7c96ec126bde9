"""Batch-invariant mode: a decoder whose every row is computed in the same order whatever else runs in its
step, so a chat's greedy reply is the same, bit for bit, with or without other chats beside it, and a prompt's
reply does not depend on how it was cut into chunks: the app's default for float weights on a GPU
(`--no-batch-invariant`: cuBLAS's kernels).

Two kinds of kernel sum a row together with others and change order with the step's shape: the GEMMs
(cuBLAS picks its algorithm by the row count) and the attention (its splits follow the batch). In this mode
the float GEMMs run `plugins.invariant_matmul` and the attention takes fixed-size splits (`plugins.fused.
INVARIANT`); the norms, RoPE and SiLU·up compute each row alone already. Its cost is in `bench/RESULTS.md`
("batch-invariant by default"). Low-bit weights' kernels are not covered: their one-row and batch kernels differ.
"""

from __future__ import annotations

from torch import Tensor, nn

from pipeline.llm.model.decoder import Decoder
from plugins.fused import INVARIANT
from plugins.invariant_matmul import invariant_linear, unavailable


class InvariantLinear(nn.Module):
    """A float linear layer whose rows are summed in an order fixed by its weight's shape alone."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters (a tied LM head stays tied)

    def forward(self, x: Tensor) -> Tensor:
        return invariant_linear(x, self.weight, self.bias)


def make_batch_invariant(model: Decoder) -> str | None:
    """Switch `model` to batch-invariant kernels in place; None when done, else why it cannot be (and nothing
    is changed)."""
    if not isinstance(model, Decoder):  # `OnnxDecoder`: the CPU's built-in chat model
        return "it runs on ONNX Runtime (a GGUF file's blocks as stored), not on the GPU's kernels"
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if len(linears) != 4 * len(model.layers) + 1:  # q/k/v, o, gate/up and down per block, and the LM head
        return "its weights are low-bit (their kernels sum a chat's row apart from a batch's); load float weights " \
               "(--quant none) for batch-invariant replies"
    weight = model.norm.weight  # float in every decoder (a GGUF one's embedding is its blocks)
    why = unavailable(weight.device, weight.dtype)
    if why is not None:
        return why
    for parent, name, child in linears:
        setattr(parent, name, InvariantLinear(child))
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = INVARIANT
    return None
