"""TensorRT as an engine builder, through Polygraphy, and the runner for its engines.

Written against TensorRT 10.x's Python API and Polygraphy 0.49+ (`network_from_onnx_path`,
`CreateConfig`, `Profile`, `engine_bytes_from_network`); imported only when this runtime is chosen.
TensorRT cannot be installed in our CI or on our GPU machine, so this module has not run: what is
tested without it is everything around it (the exported graphs, their shape profiles, the cache).

Precision: the engine runs in the app's dtype (fp16 or bf16) except the normalisation layers, which
are pinned to float32 so LayerNorm's variance cannot overflow or lose its small terms in half
precision. Softmax is left to TensorRT: its fused attention keeps the softmax in float32 itself, and
pinning those layers would break the fusion. A timing cache per device makes later builds fast.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import Tensor

from engine_builder.onnx_export import GraphSpec

NAME = "tensorrt"
ENGINE = "engine.plan"


def unavailable() -> str | None:
    """None when TensorRT and a CUDA GPU are both here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import tensorrt  # noqa: F401
        from polygraphy.backend import trt  # noqa: F401
    except ImportError as e:
        return f"TensorRT does not import ({e}); see requirements-tensorrt.txt"
    return None


def version() -> str:
    import tensorrt as trt

    return trt.__version__


def device_name() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (sm_{major}{minor})"


def precision(dtype: str) -> str:
    return dtype if dtype in ("float16", "bfloat16") else "float32"


def _pin_normalisation_to_float32(network) -> None:
    import tensorrt as trt

    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.NORMALIZATION:
            layer.precision = trt.float32
            layer.set_output_type(0, trt.float32)


def build(onnx_path: Path, folder: Path, spec: GraphSpec, precision: str) -> None:
    """Parse the ONNX graph, build an engine for the spec's shape profile, save it as `engine.plan`."""
    from polygraphy.backend.trt import CreateConfig, Profile, engine_bytes_from_network, network_from_onnx_path

    builder, network, parser = network_from_onnx_path(str(onnx_path))
    _pin_normalisation_to_float32(network)
    profile = Profile()
    for t in spec.inputs:
        profile.add(t.name, min=t.shapes[0], opt=t.shapes[1], max=t.shapes[2])
    timing_cache = str(folder.parent / f"tensorrt-timing-{device_name().replace(' ', '_')}.cache")
    config = CreateConfig(fp16=precision == "float16", bf16=precision == "bfloat16", profiles=[profile],
                          precision_constraints="obey", load_timing_cache=timing_cache)
    engine = engine_bytes_from_network((builder, network, parser), config=config, save_timing_cache=timing_cache)
    (folder / ENGINE).write_bytes(engine)  # `folder` is the cache's temporary folder: written whole or dropped


class TrtSession:
    """A deserialised engine and one execution context; calls are serialised (one context)."""

    def __init__(self, folder: Path):
        import tensorrt as trt

        self.trt = trt
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine((Path(folder) / ENGINE).read_bytes())
        if self.engine is None:
            raise RuntimeError("TensorRT could not deserialise the engine (built by another version or damaged)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._lock = threading.Lock()

    def _torch_dtype(self, name: str) -> torch.dtype:
        trt = self.trt
        return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                trt.int32: torch.int32, trt.int64: torch.int64, trt.bool: torch.bool}[self.engine.get_tensor_dtype(name)]

    def run(self, feeds: dict[str, Tensor]) -> list[Tensor]:
        with self._lock:
            inputs = {n: feeds[n].to(self.device, self._torch_dtype(n)).contiguous() for n in self.inputs}
            for name, x in inputs.items():
                self.context.set_input_shape(name, tuple(x.shape))
                self.context.set_tensor_address(name, x.data_ptr())
            outputs = [torch.empty(tuple(self.context.get_tensor_shape(n)), dtype=self._torch_dtype(n),
                                   device=self.device) for n in self.outputs]
            for name, y in zip(self.outputs, outputs):
                self.context.set_tensor_address(name, y.data_ptr())
            if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
                raise RuntimeError("TensorRT execution failed")
            return outputs
