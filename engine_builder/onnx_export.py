"""ONNX graphs of the vision networks, in the form TensorRT and ONNX Runtime build engines from.

Three graphs: SAM's image encoder (pixels → embedding), SAM's prompt encoder + mask decoder with the
inputs of the official SAM ONNX decoder (labelled points with a dynamic count and batch, an optional
previous mask switched by `has_mask_input`), and MiniGPT-4's vision side (EVA ViT-g + Q-Former +
projection → the LLM's 32 query embeddings). Each is exported from a CPU copy of the module: in
float32 for ONNX Runtime, and for TensorRT in the engine's own precision (fp16/bf16), because its
networks are strongly typed (TensorRT 11 has no other kind): the graph's dtypes decide each layer's
precision, and the normalisation layers sit in float32 islands (Casts around them). Inputs and
outputs stay float32 in every graph.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from pipeline.minigpt4.vision import VisionConfig
from pipeline.sam.image_encoder import LayerNorm2d
from pipeline.sam.model import Sam, SamConfig

OPSET = 18
MAX_PROMPT_BATCH = 64  # segment-everything decodes 64 single-point prompts at once
MAX_POINTS = 32  # clicks plus the box corners or the padding point


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One graph input: its name, dtype and shape range. `shapes` is (min, opt, max), the optimisation
    profile TensorRT builds for; all three are equal for a fixed shape."""

    name: str
    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

    @property
    def dynamic(self) -> dict[int, tuple[int, int]]:
        """Axis → (min, max) for the axes whose size varies."""
        lo, _, hi = self.shapes
        return {axis: (a, b) for axis, (a, b) in enumerate(zip(lo, hi)) if a != b}

    def example(self) -> Tensor:
        """A tracing input: the exporter would fix a dynamic axis of size 1 to 1, so those get 2."""
        shape = [max(2, opt) if axis in self.dynamic else opt for axis, opt in enumerate(self.shapes[1])]
        return torch.zeros(shape, dtype=self.dtype) if self.dtype != torch.float32 else torch.rand(shape)


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """What to export: a module wrapper taking exactly `inputs`, and the names of its outputs."""

    component: str
    make: Callable[[nn.Module], nn.Module]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]

    def profile(self) -> dict[str, list[list[int]]]:
        """The shape profile as plain data (part of an engine's cache key)."""
        return {t.name: [list(s) for s in t.shapes] for t in self.inputs}


class SamImageEncoder(nn.Module):
    def __init__(self, sam: Sam):
        super().__init__()
        self.image_encoder = sam.image_encoder

    def forward(self, pixels: Tensor) -> Tensor:
        return self.image_encoder(pixels)


class SamPromptDecoder(nn.Module):
    """Prompt encoder + mask decoder as the official SAM ONNX decoder takes them: labelled points
    (`prompt_encoder.labelled_points` builds them) and a mask input that `has_mask_input` (0 or 1)
    switches on. All four masks come out; `select_masks` picks the answer as the torch path does."""

    def __init__(self, sam: Sam):
        super().__init__()
        self.prompt_encoder = sam.prompt_encoder
        self.mask_decoder = sam.mask_decoder

    def forward(self, image_embeddings: Tensor, point_coords: Tensor, point_labels: Tensor, mask_input: Tensor,
                has_mask_input: Tensor) -> tuple[Tensor, Tensor]:
        pe = self.prompt_encoder
        sparse = pe.embed_labelled_points(point_coords, point_labels)
        no_mask = pe.no_mask_embed.weight.reshape(1, -1, 1, 1)
        dense = has_mask_input * pe.mask_downscaling(mask_input) + (1 - has_mask_input) * no_mask
        return self.mask_decoder(image_embeddings, pe.get_dense_pe(), sparse, dense)


def sam_graphs(c: SamConfig) -> tuple[GraphSpec, GraphSpec]:
    """The encoder and decoder graphs for a SAM of this configuration."""
    size, grid, dim = c.img_size, c.embedding_size, c.prompt_embed_dim
    pixels = TensorSpec("pixels", torch.float32, ((1, 3, size, size),) * 3)
    encoder = GraphSpec("sam_image_encoder", SamImageEncoder, (pixels,), ("image_embeddings",))
    decoder = GraphSpec("sam_mask_decoder", SamPromptDecoder, (
        TensorSpec("image_embeddings", torch.float32, ((1, dim, grid, grid),) * 3),
        TensorSpec("point_coords", torch.float32, ((1, 1, 2), (1, 3, 2), (MAX_PROMPT_BATCH, MAX_POINTS, 2))),
        TensorSpec("point_labels", torch.float32, ((1, 1), (1, 3), (MAX_PROMPT_BATCH, MAX_POINTS))),
        TensorSpec("mask_input", torch.float32, ((1, 1, 4 * grid, 4 * grid),) * 3),
        TensorSpec("has_mask_input", torch.float32, ((1,),) * 3),
    ), ("masks", "iou_predictions"))
    return encoder, decoder


def minigpt4_graph(c: VisionConfig) -> GraphSpec:
    size = c.img_size
    return GraphSpec("minigpt4_vision", lambda m: m, (
        TensorSpec("pixels", torch.float32, ((1, 3, size, size),) * 3),), ("query_embeddings",))


class Float32Island(nn.Module):
    """A normalisation layer computed in float32 inside a half-precision graph: the Casts around it are
    what a strongly typed TensorRT network reads as "keep this in float32" (LayerNorm's variance would
    overflow or lose its small terms in fp16)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm.float()

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.float()).to(x.dtype)


class TypedGraph(nn.Module):
    """`inner` in `dtype`, with float32 inputs and outputs, so every runtime feeds and reads the engine alike."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, *inputs: Tensor):
        out = self.inner(*(x.to(self.dtype) if x.is_floating_point() else x for x in inputs))
        return tuple(y.float() for y in out) if isinstance(out, tuple) else out.float()


def typed(wrapper: nn.Module, dtype: torch.dtype) -> TypedGraph:
    """`wrapper` as a `dtype` graph: weights in `dtype`, normalisation layers in float32 islands (for
    float32, the graph as it is)."""
    if dtype == torch.float32:
        return TypedGraph(wrapper, dtype)
    norms = [(parent, name) for parent in wrapper.modules() for name, child in parent.named_children()
             if isinstance(child, (nn.LayerNorm, LayerNorm2d))]
    wrapper = wrapper.to(dtype)
    for parent, name in norms:
        setattr(parent, name, Float32Island(getattr(parent, name)))
    return TypedGraph(wrapper, dtype)


def export_onnx(spec: GraphSpec, module: nn.Module, path: Path, dtype: torch.dtype = torch.float32) -> None:
    """Export `spec.make(module)` (a CPU copy) to `path`, as a `dtype` graph (`typed`) with float32
    inputs and outputs; weights go to `path` + ".data" beside it, so graphs of any size (SAM ViT-H is
    2.5 GB in float32) stay under protobuf's 2 GB limit."""
    with torch.device("cpu"):
        wrapper = typed(copy.deepcopy(spec.make(module)).float().cpu().eval(), dtype)  # only this graph's parts
    examples = tuple(t.example() for t in spec.inputs)
    dims = {t.name: {axis: torch.export.Dim(f"{t.name}_{axis}", min=lo, max=hi) for axis, (lo, hi) in t.dynamic.items()}
            or None for t in spec.inputs}
    _share_dims(spec, dims)
    log = io.StringIO()
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings(), \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(wrapper, examples, input_names=[t.name for t in spec.inputs],
                                    output_names=list(spec.outputs), opset_version=OPSET, dynamo=True,
                                    dynamic_shapes=(tuple(dims[t.name] for t in spec.inputs),),  # TypedGraph's *inputs
                                    external_data=True, optimize=True, verbose=False)
        program.save(str(path), external_data=True)


def _share_dims(spec: GraphSpec, dims: dict[str, dict | None]) -> None:
    """Inputs whose leading axes vary together (points and their labels) get the same Dim objects."""
    seen: dict[tuple[int, tuple[int, int]], torch.export.Dim] = {}
    for t in spec.inputs:
        for axis, bounds in t.dynamic.items():
            dims[t.name][axis] = seen.setdefault((axis, bounds), dims[t.name][axis])
