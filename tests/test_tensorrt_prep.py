"""TensorRT preparation that needs no TensorRT (it cannot be installed here): the graphs a strongly
typed network is built from (fp16/bf16 weights, float32 normalisation islands, float32 inputs and
outputs), and the versions the builder accepts."""

import onnx
import pytest
import torch
from onnx import TensorProto

from engine_builder.onnx_export import export_onnx, minigpt4_graph, sam_graphs
from engine_builder.tensorrt_backend import version_problem
from pipeline.minigpt4.vision import TINY, MiniGPT4Vision
from pipeline.random_weights import spread_weights
from pipeline.sam.model import VARIANTS, Sam

LOW = {torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16}


def exported(tmp_path, graph, module, dtype) -> onnx.ModelProto:
    path = tmp_path / f"{graph.component}.onnx"
    export_onnx(graph, module, path, dtype)
    return onnx.shape_inference.infer_shapes(onnx.load(str(path)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("which", ["sam_image_encoder", "minigpt4_vision"])
def test_a_typed_graph_carries_its_precision_with_float32_normalisation(tmp_path, dtype, which):
    if which == "sam_image_encoder":
        module = spread_weights(lambda: Sam(VARIANTS["demo"]), seed=1).eval()
        graph = sam_graphs(module.config)[0]
    else:
        module, graph = spread_weights(lambda: MiniGPT4Vision(TINY), seed=1).eval(), minigpt4_graph(TINY)
    model = exported(tmp_path, graph, module, dtype)
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input,
                                                           *model.graph.output]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    assert {types[i.name] for i in model.graph.input} == {TensorProto.FLOAT}  # fed alike by every runtime
    assert {types[o.name] for o in model.graph.output} == {TensorProto.FLOAT}
    matmul_weights = [types[n] for node in model.graph.node if node.op_type in ("MatMul", "Gemm", "Conv")
                      for n in node.input if n in types]
    assert matmul_weights and set(matmul_weights) == {LOW[dtype]}  # the products run in the engine's precision
    norms = [node for node in model.graph.node if node.op_type == "LayerNormalization"]
    assert norms and all(types[node.input[0]] == TensorProto.FLOAT for node in norms)  # float32 islands


def test_the_float32_graph_is_unchanged_for_onnx_runtime(tmp_path):
    module = spread_weights(lambda: MiniGPT4Vision(TINY), seed=1).eval()
    model = exported(tmp_path, minigpt4_graph(TINY), module, torch.float32)
    assert {t.data_type for t in model.graph.initializer if len(t.dims) > 1} == {TensorProto.FLOAT}


@pytest.mark.parametrize("tensorrt, polygraphy, ok", [
    ("10.7.0.23", "0.53.6", False), ("10.8.0.43", "0.53.6", True), ("10.14.1.48", "0.53.4", True),
    ("11.4.0.106", "0.53.6", True), ("12.0.0.1", "0.53.6", False), ("11.4.0.106", "0.49.20", False),
])
def test_the_builder_names_the_tensorrt_and_polygraphy_it_was_written_for(tensorrt, polygraphy, ok):
    problem = version_problem(tensorrt, polygraphy)
    assert (problem is None) == ok, problem
    if not ok:
        assert (tensorrt if "TensorRT " + tensorrt in problem else polygraphy) in problem
