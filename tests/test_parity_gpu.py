"""The parity suite's CI shapes on a CUDA GPU (run on the H200): every check with the Triton and
Pallas kernels compiled, CUDA numerics in both frameworks, and a Triton|Pallas end-to-end pair.
The full shapes (Ouro heads, 4K contexts, bf16 end to end) are `python -m parity` there."""

import pytest
import torch

from parity.checks import CHECKS
from test_parity import assert_check_passes  # tests/ is on sys.path under pytest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def suite():
    from parity.suite import Suite

    return Suite(quick=True)


def test_kernels_compiled_on_gpu(suite):
    import os

    assert suite.settings.device == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    assert not suite.unavailable, suite.unavailable
    assert {"torch-triton", "jax-pallas"} <= {i.name for i in suite.impls}
    assert any(run.kernels == "torch-triton|jax-pallas" for run in suite.settings.e2e)


@pytest.mark.parametrize("name", list(CHECKS))
def test_check(suite, name):
    assert_check_passes(suite, name)
