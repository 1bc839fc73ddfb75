"""Property: torch's and JAX's select_blocks equal wise_core.reference.select_blocks on any
float32 masses (subnormals included: the rule counts them as zero), except bits decided within
float32 rounding of the threshold: the mass ranked before the block within
2 * n_blocks * eps32 * total of eta * total (parity.checks.support_differences)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.checks import support_differences
from parity.impls import selectors

SELECT = selectors("cpu")
VALUES = st.one_of(st.floats(0.0, 1.0, width=32), st.sampled_from([0.0, 0.125, 0.5, 1e-30, 2e-38, 1e-40]))


@st.composite
def masses(draw) -> np.ndarray:
    rows, n = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 5, 32]))  # few shapes: few compilations
    return np.array(draw(st.lists(VALUES, min_size=rows * n, max_size=rows * n)), np.float32).reshape(rows, n)


@settings(max_examples=80, deadline=None)
@given(masses(), st.one_of(st.just(1.0), st.just(0.95), st.floats(0.01, 1.0)))
def test_select_blocks_match_the_spec(mass, eta):
    want = SELECT["numpy-spec"](mass, eta)
    for name in ("torch", "jax"):
        got = SELECT[name](mass, eta)
        assert got.dtype == bool and got.shape == mass.shape
        diffs = support_differences(mass, eta, got, want)
        assert all(d.explained for d in diffs), (name, [d.describe() for d in diffs])


def test_support_differences_names_margins():
    mass = np.array([[0.5, 0.45, 0.05]], np.float32)
    want = np.array([[True, True, False]])
    [near] = support_differences(mass, 0.95, np.array([[True, True, True]]), want)
    assert (near.row, near.block, near.kept) == ((0,), 2, True)
    assert near.explained and near.straddle < 1e-7  # 0.5 + 0.45 lies on eta * total = 0.95
    [far] = support_differences(mass, 0.95, np.array([[True, False, False]]), want)
    assert not far.explained and abs(far.straddle - 0.45) < 1e-6
    assert "row [0] block 1 dropped (spec: kept)" in far.describe()
