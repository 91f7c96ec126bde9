"""The model layer: the decoder (`decoder.py`) and what it reads a step through (its KV cache, rotary tables and
step parts), the ONNX Runtime stand-in for it, and loading a checkpoint's weights into one (`loading.py`)."""
