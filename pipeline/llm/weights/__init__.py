"""Weights: configs, checkpoints in every on-disk format (HF folders, GGUF files, AWQ/GPTQ), quantization."""
