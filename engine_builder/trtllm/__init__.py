"""TensorRT-LLM for the chat and image-chat LLMs: checkpoint preparation (runs anywhere, tested),
engine building and the runner behind the `LLMEngine` seam (need TensorRT-LLM; imported lazily).

Target: TensorRT-LLM {TARGET} (its TensorRT engine path: checkpoint → `tensorrt_llm.builder.build`
→ the C++ executor). TensorRT-LLM cannot be installed in our CI or on our GPU machine, so the
build and the runner have not run here; `unavailable()` says so and the LLMs run on torch.
"""

from __future__ import annotations

TARGET = "0.21.0"
__doc__ = __doc__.format(TARGET=TARGET)


def unavailable() -> str | None:
    """None when TensorRT-LLM imports (and is the version these modules are written for), else why not."""
    try:
        import tensorrt_llm
    except Exception as e:  # noqa: BLE001: a broken install fails in many ways (ImportError, OSError, ...)
        return f"TensorRT-LLM does not import ({type(e).__name__}: {e}); see requirements-tensorrt.txt"
    if tensorrt_llm.__version__ != TARGET:
        return f"TensorRT-LLM {tensorrt_llm.__version__} is installed; this build is written for {TARGET}"
    return None
