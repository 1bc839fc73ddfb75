"""Test-wide environment, set before any test module imports triton or jax, and what each test
module leaves behind."""

import gc
import os
import sys

import pytest


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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop jax's compiled programs (and what only they held): a
    whole-suite process otherwise keeps every XLA executable of every module, and after some
    thousand of them XLA's CPU compiler crashed (segmentation fault or abort) in a later compile."""
    yield
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
        gc.collect()
