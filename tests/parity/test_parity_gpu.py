"""The parity suite's CI shapes on a CUDA GPU (run on the H200): the checks that do not generate
(weights, decode-attention calls, selection) with the Triton and Pallas kernels compiled and CUDA
numerics. Generation checks, full shapes (Ouro heads, 4K contexts) and bf16 end to end are
`python -m parity` there, kept out of this file to keep the GPU test run short."""

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


@pytest.mark.parametrize("name", [n for n in CHECKS if n not in ("all-blocks-generate", "end-to-end")])
def test_check(suite, name):
    assert_check_passes(suite, name)
