"""The numpy spec of WISE decode on Huginn (`huginn_forward(..., wise=)`) and the Huginn WISE
profile (`huginn_wise_config`): every block selected is dense decode; bad depths are refused."""

import numpy as np
import pytest

from huginn_cases import STEPS, TINY, WISE, checkpoint, prompts
from wise_core.config_error import ConfigError
from wise_core.huginn_reference import HuginnCache, huginn_forward, huginn_weights
from wise_core.wise_config import WiseConfig, huginn_wise_config


def test_huginn_wise_config():
    wise = huginn_wise_config()
    assert (wise.discover_depths, wise.reuse_depths) == ((0, 1), tuple(range(2, 32)))
    assert huginn_wise_config(8, eta=0.9, block_size=64).reuse_depths == (2, 3, 4, 5, 6, 7)
    assert huginn_wise_config(8, eta=0.9).eta == 0.9
    with pytest.raises(ConfigError, match="needs num_steps >= 3 core iterations"):
        huginn_wise_config(2)
    with pytest.raises(ConfigError, match="discovery depth 31 is past 30"):
        WiseConfig(discover_depths=(0, 31), reuse_depths=())


def test_all_blocks_is_dense_and_sparse_is_not(tmp_path):
    """Decode steps after a prefill: WISE with every causal block selected gives dense decode's
    logits; WISE at eta 0.8 does not (its reuse iteration leaves blocks out)."""
    weights = huginn_weights(TINY, checkpoint(tmp_path).tensors)
    prompt = prompts()[0]
    runs = {}
    for name, wise in (("dense", None), ("all", WiseConfig(block_size=16, discover_depths=(0, 1),
                                                           reuse_depths=(3,), all_blocks=True)), ("wise", WISE)):
        cache = HuginnCache()
        huginn_forward(TINY, weights, prompt, num_steps=STEPS, cache=cache)
        runs[name] = np.stack([huginn_forward(TINY, weights, [t], num_steps=STEPS, cache=cache, wise=wise)[0]
                               for t in (3, 141, 59)])
    scale = np.abs(runs["dense"]).max()
    # float64 on both sides, the attention summed in another order (wise_core.reference.attention vs
    # the causal one): unit roundoff 1.1e-16 over ~20 sublayers of <= 256-term sums is ~1e-13 relative
    assert np.abs(runs["all"] - runs["dense"]).max() <= 1e-11 * scale
    assert np.abs(runs["wise"] - runs["dense"]).max() > 1e-3 * scale


def test_bad_calls_are_refused(tmp_path):
    weights = huginn_weights(TINY, checkpoint(tmp_path).tensors)
    with pytest.raises(ConfigError, match=r"WISE depths \[3\] are out of range for num_steps=3 core iterations"):
        huginn_forward(TINY, weights, [1], num_steps=3, wise=WISE)
    with pytest.raises(ValueError, match="WISE decodes one token a call, got 2 tokens"):
        huginn_forward(TINY, weights, [1, 2], num_steps=STEPS, wise=WISE)
