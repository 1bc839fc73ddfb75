"""wise_core.evaluation: the bootstrap intervals and an arm's numbers on hand-made results."""

import math

import numpy as np
import pytest

from wise_core.evaluation import Arm, common_prefix, paired_bootstrap, ratio_bootstrap
from wise_core.wise_config import WiseConfig


def test_ratio_bootstrap_pools_and_brackets_the_ratio():
    bits, nbytes = np.array([8.0, 4.0, 12.0, 6.0]), np.array([4, 4, 8, 4])
    ratio, low, high = ratio_bootstrap(bits, nbytes)
    assert ratio == 30.0 / 20.0                                   # pooled, not a mean of ratios (1.5 either way here)
    assert min(b / n for b, n in zip(bits, nbytes)) <= low <= ratio <= high <= max(b / n for b, n in zip(bits, nbytes))
    assert ratio_bootstrap(bits, nbytes, seed=3) == ratio_bootstrap(bits, nbytes, seed=3)
    same = ratio_bootstrap(np.full(5, 2.0), np.full(5, 4))
    assert same == (0.5, 0.5, 0.5)                                 # no spread: a point interval
    with pytest.raises(ValueError, match="every denominator must be positive"):
        ratio_bootstrap([1.0], [0])
    with pytest.raises(ValueError, match="one length"):
        ratio_bootstrap([1.0, 2.0], [1])


def test_arm_numbers_on_hand_made_results():
    lp = [np.log(np.array([0.5, 0.25], np.float32)), np.log(np.array([0.5, 0.5], np.float32))]   # 3 and 2 bits
    dense = Arm(None, lp, np.array([2, 1]), [[1, 2, 3], [4, 5, 6]], None, None)
    wise = Arm(WiseConfig(eta=0.9), [x - np.float32(math.log(2)) for x in lp], np.array([2, 1]),
               [[1, 2, 9], [7, 5, 6]], {2: 0.5, 3: 0.25}, 0, dense)
    assert dense.label == "dense" and wise.label == "eta=0.9"
    assert dense.bits_per_byte["mean"] == pytest.approx(5 / 3, rel=1e-6)          # float32 log-probs
    assert wise.bits_per_byte["mean"] == pytest.approx(9 / 3, rel=1e-6)           # one more bit per token
    assert wise.nll_diff["mean"] == pytest.approx(math.log(2), rel=1e-6)
    assert wise.prefix_agreement.tolist() == [2 / 3, 0.0] and wise.tokens_changed == 2 / 6
    summary = wise.summary()
    assert summary["arm"] == "eta=0.9" and summary["density"] == {"2": 0.5, "3": 0.25}
    assert summary["tokens_changed"] == 2 / 6 and summary["greedy_prefix_agreement"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="arm 'dense' has no dense arm to compare with"):
        dense.tokens_changed
    assert "nll_diff" not in dense.summary()


def test_paired_bootstrap_and_common_prefix():
    a = np.arange(10.0)
    assert paired_bootstrap(a, a - 1.0) == (1.0, 1.0, 1.0)
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
