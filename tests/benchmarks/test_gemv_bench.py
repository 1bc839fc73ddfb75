"""benchmarks/kernels/gemv_bench.py's Triton skinny projection against float64 products, in the Triton
interpreter on a CPU (tests/conftest.py sets TRITON_INTERPRET): float32 at small shapes, tiles
cut so that n and k leave partial tiles."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernels.gemv_bench import MAX_ROWS, GemvConfig, gemv, supports

pytestmark = pytest.mark.cuda   # on the GPU when there is one (the gpu suite runs it there)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=1)


def _inputs(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype=dtype, device=DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype=dtype, device=DEVICE)
    return x, w


@pytest.mark.parametrize("m", [1, 3, MAX_ROWS])
def test_float32_matches_the_float64_product(m):
    x, w = _inputs(m, 40, 80, torch.float32)     # 3 column tiles (the last partial), 3 k tiles (partial)
    y = gemv(x, w, config=SMALL)
    want = x.double() @ w.double().T
    # Basis: float32 products summed over k = 80 (in tiles of 32): |error| <~ k * 2^-24 * sum|x w|.
    bound = 80 * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert y.shape == (m, 40) and y.dtype == torch.float32
    assert ((y.double() - want).abs() <= bound).all()


def test_a_row_is_its_own_result_alone_and_nan_stays_in_its_row():
    x, w = _inputs(5, 40, 80, torch.float32, seed=1)
    y = gemv(x, w, config=SMALL)
    for i in range(5):
        assert torch.equal(gemv(x[i:i + 1], w, config=SMALL)[0], y[i])   # bitwise: rows never mix
    x[2, 7] = float("nan")
    y = gemv(x, w, config=SMALL)
    assert y[2].isnan().all() and not y[[0, 1, 3, 4]].isnan().any()


def test_writes_into_out():
    x, w = _inputs(2, 24, 48, torch.float32, seed=2)
    out = torch.full((2, 24), 7.0, device=DEVICE)
    assert gemv(x, w, out, config=SMALL) is out
    assert torch.equal(out, gemv(x, w, config=SMALL))


def test_bad_calls_are_errors_naming_the_problem():
    x, w = _inputs(MAX_ROWS + 1, 16, 32, torch.float32)
    assert not supports(x, w)
    with pytest.raises(ValueError, match=r"x \[1..8, k\]"):
        gemv(x, w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x[:2].double(), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x[:2, :16], w)                                # k differs
    with pytest.raises(ValueError, match="out must be"):
        gemv(x[:2], w, torch.empty(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=24)
    with pytest.raises(ValueError, match=">= 16"):
        GemvConfig(block_k=8)
