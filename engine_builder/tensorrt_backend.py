"""TensorRT as an engine builder, through Polygraphy, and the runner for its engines.

Targets TensorRT 10.8+ and 11.x with Polygraphy 0.53.4+ (`network_from_onnx_path(strongly_typed=True)`,
`CreateConfig`, `Profile`, `engine_bytes_from_network`); imported only when this runtime is chosen.
TensorRT cannot be installed in our CI or on our GPU machine, so this module has not run: it was
written against those releases' sources, and what is tested without it is everything around it (the
typed ONNX graphs, their shape profiles, the cache, the check every new engine must pass).

Precision: networks are strongly typed, the only kind TensorRT 11 builds (it removed the fp16/bf16
builder flags and per-layer precision; 10.x refuses those flags on a strongly typed network). So the
ONNX graph itself is exported in the engine's precision, with the normalisation layers in float32
islands (`onnx_export.typed`), and the builder gets no precision flags. Softmax is left to TensorRT's
fused attention, which keeps it in float32 itself. A timing cache per device makes later builds fast.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import Tensor

from engine_builder.onnx_export import GraphSpec

NAME = "tensorrt"
ENGINE = "engine.plan"


SUPPORTED = ((10, 8), (11, 99))  # TensorRT (major, minor) from, to: strongly typed networks throughout
POLYGRAPHY_FROM = (0, 53, 4)  # older releases read builder fields TensorRT 11 removed


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def unavailable() -> str | None:
    """None when a supported TensorRT, Polygraphy and a CUDA GPU are all here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import polygraphy
        import tensorrt
        from polygraphy.backend import trt  # noqa: F401
    except ImportError as e:
        return f"TensorRT does not import ({e}); see requirements-tensorrt.txt"
    return version_problem(tensorrt.__version__, polygraphy.__version__)


def version_problem(tensorrt_version: str, polygraphy_version: str) -> str | None:
    """Why this TensorRT / Polygraphy pair cannot build our engines, or None."""
    release = _release(tensorrt_version)[:2]
    if not SUPPORTED[0] <= release <= SUPPORTED[1]:
        return (f"TensorRT {tensorrt_version} is installed; the vision builder is written for TensorRT "
                f"10.8 to 11.x (see requirements-tensorrt.txt)")
    if _release(polygraphy_version) < POLYGRAPHY_FROM:
        return f"Polygraphy {polygraphy_version} is installed; TensorRT 11 needs 0.53.4 or later"
    return None


def version() -> str:
    import tensorrt as trt

    return trt.__version__


def device_name() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (sm_{major}{minor})"


def precision(dtype: str) -> str:
    return dtype if dtype in ("float16", "bfloat16") else "float32"


def build(onnx_path: Path, folder: Path, spec: GraphSpec, precision: str) -> None:
    """Parse the (typed) ONNX graph, build an engine for the spec's shape profile, save it as `engine.plan`."""
    from polygraphy.backend.trt import CreateConfig, Profile, engine_bytes_from_network, network_from_onnx_path

    builder, network, parser = network_from_onnx_path(str(onnx_path), strongly_typed=True)  # the graph's dtypes rule
    profile = Profile()
    for t in spec.inputs:
        profile.add(t.name, min=t.shapes[0], opt=t.shapes[1], max=t.shapes[2])
    timing_cache = str(folder.parent / f"tensorrt-timing-{device_name().replace(' ', '_')}.cache")
    config = CreateConfig(profiles=[profile], load_timing_cache=timing_cache)  # no precision flags: see above
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
