"""wise_core.reference: the selection rule on hand-made rows, and its helpers."""

import numpy as np
import pytest

from wise_core import reference as ref

# (mass row, eta, expected support)
CASES = {
    "equal-ties-lowest-index": ([0.25, 0.25, 0.25, 0.25], 0.5, [1, 1, 0, 0]),
    "pairwise-ties": ([0.1, 0.4, 0.1, 0.4], 0.5, [0, 1, 0, 1]),
    "tie-broken-to-lower-index": ([0.1, 0.4, 0.1, 0.4], 0.85, [1, 1, 0, 1]),
    "all-zero-keeps-first": ([0.0, 0.0, 0.0], 0.95, [1, 0, 0]),
    "zero-blocks-never-with-eta-1": ([0.0, 0.5, 0.0, 0.5], 1.0, [0, 1, 0, 1]),
    "eta-1-keeps-every-positive": ([0.1, 0.2, 0.3, 0.4], 1.0, [1, 1, 1, 1]),
    "single-block": ([0.7], 0.95, [1]),
    "single-zero-block": ([0.0], 0.95, [1]),
    "top-block-alone": ([0.01, 0.96, 0.03], 0.95, [0, 1, 0]),
    "reach-exactly": ([0.5, 0.25, 0.25], 0.75, [1, 1, 0]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_select_blocks_hand_made(name):
    mass, eta, expected = CASES[name]
    got = ref.select_blocks(np.array(mass, np.float32), eta)
    assert got.dtype == bool
    np.testing.assert_array_equal(got, np.array(expected, bool))


def test_select_blocks_rows_are_independent():
    rows = [CASES[n] for n in ("pairwise-ties", "eta-1-keeps-every-positive")]
    stacked = np.array([r[0] for r in rows], np.float32)
    np.testing.assert_array_equal(ref.select_blocks(stacked, 0.5)[0], np.array([0, 1, 0, 1], bool))
    np.testing.assert_array_equal(ref.select_blocks(stacked[:, None, :], 1.0)[:, 0],
                                  np.array([[1, 1, 1, 1], [1, 1, 1, 1]], bool))


@pytest.mark.parametrize("mass, eta, message", [
    (np.zeros((2, 0), np.float32), 0.9, "non-empty"),
    (np.float32(1.0), 0.9, "non-empty"),
    (np.ones(3, np.float32), 0.0, "eta"),
    (np.ones(3, np.float32), 1.5, "eta"),
    (np.array([0.5, -0.1], np.float32), 0.9, "non-negative"),
    (np.array([0.5, np.nan], np.float32), 0.9, "finite"),
    (np.array([0.5, np.inf], np.float32), 0.9, "finite"),
])
def test_select_blocks_rejects_bad_input(mass, eta, message):
    with pytest.raises(ValueError, match=message):
        ref.select_blocks(mass, eta)


def test_block_mass_and_density():
    probs = np.array([0.1, 0.2, 0.3, 0.4, 0.0], np.float64)
    np.testing.assert_allclose(ref.block_mass(probs, 2), [0.3, 0.7, 0.0])
    np.testing.assert_allclose(ref.block_mass(probs, 2, n_blocks=4), [0.3, 0.7, 0.0, 0.0])
    with pytest.raises(ValueError, match="do not fit"):
        ref.block_mass(probs, 2, n_blocks=2)
    np.testing.assert_array_equal(ref.causal_blocks(65, 32, 4), [True, True, True, False])
    support = np.array([[True, False, True, True], [True, True, True, True]])
    assert ref.support_density(support, 65, 32) == pytest.approx((2 / 3 + 1) / 2)


def test_attention_all_blocks_support_equals_dense():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(4, 8)), rng.normal(size=(70, 2, 8)), rng.normal(size=(70, 2, 8))
    dense, mass = ref.attention(q, k, v, block_size=32)
    sparse, _ = ref.attention(q, k, v, block_size=32, support=ref.all_blocks(70, 32, (4,), 3))
    np.testing.assert_array_equal(dense, sparse)
    np.testing.assert_allclose(mass.sum(-1), 1.0, rtol=1e-12)
