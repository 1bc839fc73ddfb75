"""Test-wide environment, set before any test module imports triton or jax."""

import os


def _torch_cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    # Test shapes are tiny: one intra-op thread is as fast and does not spin against other work.
    torch.set_num_threads(1)
    return torch.cuda.is_available()


if not _torch_cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU in the interpreter
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
