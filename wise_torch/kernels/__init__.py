"""Kernels of wise_torch, imported lazily: `triton_decode`, `triton_verify` and `fused` need
triton, `fa4` imports flash-attn-4 on first use."""
