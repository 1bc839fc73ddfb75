"""Triton kernels of wise_torch (imported lazily: `wise_torch.kernels.triton_decode` needs triton)."""
