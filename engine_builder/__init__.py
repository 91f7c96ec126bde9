"""Engines built on first launch and cached: ONNX export → ONNX Runtime or TensorRT for the vision
networks, our checkpoints → TensorRT-LLM for the LLMs.

`onnx_export` makes the graphs, `build` builds or loads them through `cache` (keys, metadata, locks,
checks) with a runtime from its table (`onnxruntime_backend`, `tensorrt_backend`) and proves them
(`engine_check`); the loaded sessions go behind the seams in `pipeline` (`SessionSamEngine`,
`SessionVisionEncoder`). `trtllm/` builds TensorRT-LLM engines and runs them behind the LLM seam (its
runner stays here: it is one piece with its build workflow and the package it probes). TensorRT and TensorRT-LLM are imported only when chosen:
they cannot be installed in our CI or on our GPU machine, so their modules say so in their
docstrings and the README says what was verified where.
"""
