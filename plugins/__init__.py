"""GPU kernels (Triton), one source each, with a torch reference beside them: `fused` (RMSNorm, add +
RMSNorm, RoPE, SiLU·up), `lowbit` and `lowbit_tuning` (int8/int4 weight-only products), `topk_sampling`
and `decode_attention`."""
