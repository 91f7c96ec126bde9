"""Fused GPU kernels (Triton), one source each: `fused` (the torch path's kernels) and
`tensorrt_rms_norm` (the same RMSNorm kernel registered as a TensorRT plugin)."""
