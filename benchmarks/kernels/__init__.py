"""Decode-attention kernels on their own: the Triton, Pallas and Mosaic WISE kernels against cuDNN
SDPA and FlashAttention-4, the fused decode-path ops, the skinny projections."""
