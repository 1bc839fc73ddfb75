"""Process settings that must precede the first import of triton or jax (imported for effect).

Without a CUDA device, Triton kernels run in the interpreter (`TRITON_INTERPRET=1`); XLA does not
preallocate the GPU that torch shares. Both only set defaults: an explicit setting wins.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
