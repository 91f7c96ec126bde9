"""TensorRT-LLM for the chat and image-chat LLMs: checkpoint preparation (runs anywhere, tested),
engine building and the runner behind the `LLMEngine` seam (need TensorRT-LLM; imported lazily).

Target: TensorRT-LLM {TARGET} (CUDA 13, torch 2.9.1, TensorRT 10.14), its TensorRT-engine workflow:
checkpoint → `tensorrt_llm.builder.build` → `tensorrt_llm.bindings.executor`. Why that workflow and
not the 1.x default (the PyTorch `LLM` API): image chat puts its image embeddings in the middle of a
prompt through a prompt table, which the executor takes per request (`PromptTuningConfig`, as the
release's own `ModelRunnerCpp` does for its multimodal examples), while the LLM API's TensorRT path
only takes a prompt adapter at the start. 1.2 is the last release line with this workflow (it was
removed from the sources after it): stay on it, or serve a bigger model with `trtllm-serve` and
`--llm-endpoint`. TensorRT-LLM cannot be installed in our CI or on our GPU machine, so the build and
the runner have not run here: they were written against the 1.2 sources; `unavailable()` says why
not and the LLMs run on torch.
"""

from __future__ import annotations

TARGET = "1.2.1"
LINE = "1.2."  # releases with the same API
__doc__ = __doc__.format(TARGET=TARGET)


def unavailable() -> str | None:
    """None when TensorRT-LLM imports (and is the release line these modules are written for), else why not."""
    try:
        import tensorrt_llm
    except Exception as e:  # noqa: BLE001: a broken install fails in many ways (ImportError, OSError, ...)
        return f"TensorRT-LLM does not import ({type(e).__name__}: {e}); see requirements-tensorrt.txt"
    return version_problem(tensorrt_llm.__version__)


def version_problem(version: str) -> str | None:
    if not version.startswith(LINE):
        return f"TensorRT-LLM {version} is installed; this build is written for {TARGET} (the {LINE}x line)"
    return None
