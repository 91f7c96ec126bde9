"""Fused GPU kernels (Triton), one source each, exposed as torch ops and TensorRT plugins.

Empty for now: the torch backend runs on stock PyTorch kernels.
"""
