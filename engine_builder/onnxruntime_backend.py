"""ONNX Runtime as an engine builder: the engine is the exported graph after ONNX Runtime's graph
optimisations (fusions, constant folding, and on the CPU its blocked memory layouts), saved once and
loaded later with optimisation switched off, so a launch skips that work.

Providers are chosen by what is installed: TensorRT's (which keeps its own engine cache inside the
engine folder), CUDA's, then the CPU's. The `onnxruntime` wheel in requirements.txt has only the CPU
provider; `onnxruntime-gpu` adds the others.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch
from torch import Tensor

from engine_builder.onnx_export import GraphSpec

NAME = "onnxruntime"
ENGINE = "engine.onnx"
PREFERRED = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def unavailable() -> str | None:
    """None when ONNX Runtime imports, else why not."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as e:
        return f"onnxruntime does not import ({e})"
    return None


def providers() -> list[str]:
    import onnxruntime as ort

    installed = ort.get_available_providers()
    chosen = [p for p in PREFERRED if p in installed]
    return chosen if torch.cuda.is_available() else ["CPUExecutionProvider"]


def version() -> str:
    import onnxruntime as ort

    return f"{ort.__version__} ({', '.join(providers())})"


def device_name() -> str:
    if providers()[0] != "CPUExecutionProvider":
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    return f"CPU {platform.machine()} {cpu_model()}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def precision(dtype: str) -> str:
    """float32 on the CPU provider (whatever the app's dtype); TensorRT's provider runs fp16."""
    return "float16" if providers()[0] == "TensorrtExecutionProvider" else "float32"


def _provider_options(folder: Path) -> list:
    options = {"TensorrtExecutionProvider": {"trt_engine_cache_enable": True, "trt_fp16_enable": True,
                                             "trt_engine_cache_path": str(folder / "tensorrt"),
                                             "trt_timing_cache_enable": True}}
    return [(p, options.get(p, {})) for p in providers()]


def build(onnx_path: Path, folder: Path, spec: GraphSpec, precision: str) -> None:
    """Optimise the graph for the providers at hand and save the result as the engine."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # not its warning that CPU-optimised graphs are CPU-specific: the key says so
    so = ort.SessionOptions()
    cpu_only = providers() == ["CPUExecutionProvider"]
    # The CPU's layout transformations are CPU-specific: saved only where the CPU runs the engine.
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if cpu_only
                                   else ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    so.optimized_model_filepath = str(folder / ENGINE)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", ENGINE + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(onnx_path), so, providers=_provider_options(folder))


class OrtSession:
    """A loaded engine: named tensors in, output tensors out (on the CPU)."""

    def __init__(self, folder: Path):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # done when it was built
        self.session = ort.InferenceSession(str(folder / ENGINE), so, providers=_provider_options(folder))
        self.device = torch.device("cpu")

    def run(self, feeds: dict[str, Tensor]) -> list[Tensor]:
        outputs = self.session.run(None, {k: v.detach().float().cpu().numpy() for k, v in feeds.items()})
        return [torch.from_numpy(o) for o in outputs]
