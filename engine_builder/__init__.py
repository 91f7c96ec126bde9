"""TensorRT / TensorRT-LLM engine building and caching (not built yet: the torch backend runs).

The TensorRT builder and TensorRT-LLM cannot be installed in this workplace; the engine path will
be written against their documented APIs, imported lazily, and everything around it that runs
without them (ONNX export checks, cache keys, build configs) tested here. Until then `launch.py`
reports `--backend auto` as the torch backend and says why.
"""
