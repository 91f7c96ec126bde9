"""Qwen2.5-VL: a windowed ViT with 2-D rotary positions whose merged patches feed a Qwen2.5 decoder."""
