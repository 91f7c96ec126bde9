"""Engines built on first launch and cached: ONNX export → ONNX Runtime or TensorRT for the vision
networks, our checkpoints → TensorRT-LLM for the LLMs.

`onnx_export` makes the graphs, `build` builds or loads them through `cache` (keys, metadata, locks,
checks) with a runtime from its table (`onnxruntime_backend`, `tensorrt_backend`), and
`vision_engines` puts the loaded engines behind the same seams the torch engines implement;
`trtllm/` does the same for TensorRT-LLM. TensorRT and TensorRT-LLM are imported only when chosen:
they cannot be installed in our CI or on our GPU machine, so their modules say so in their
docstrings and the README says what was verified where.
"""
