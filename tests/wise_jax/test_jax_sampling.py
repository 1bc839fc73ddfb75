"""wise_jax.sampling.sample at every temperature from 1e-30 to 1e3: greedy where the softmax
is a point mass, the softmax(logits / T) distribution elsewhere, top-p restricting it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_jax.sampling import sample

LOGITS = np.array([2.0, -1.0, 3.5, 0.0, 3.25, -7.0, 1.0, 12.0, 11.0, -30.0, 0.5, 2.5], np.float32)
DRAWS = 4096

_sample = jax.jit(sample)


def _draws(logits: np.ndarray, temperature: float, top_p: float = 1.0, seed: int = 0,
           rows: int = DRAWS) -> np.ndarray:
    """`rows` independent samples: one row per draw, one key for the batch (rows draw independently)."""
    batch = jnp.broadcast_to(jnp.asarray(logits), (rows, logits.size))
    return np.asarray(_sample(batch, jax.random.PRNGKey(seed), jnp.float32(temperature), jnp.float32(top_p)))


@pytest.mark.parametrize("temperature", [1e-30, 1e-20, 1e-10, 1e-6, 1e-3])
def test_tiny_temperatures_are_greedy(temperature):
    """The top two logits differ by 1, so at T <= 1e-3 the runner-up has probability
    exp(-1000) = 0 in float32: every draw is the argmax. Batches of 8 rows, as generate's: the
    linear-space softmax lost its max entry to the rounding of logits / T there (all
    probabilities 0, hence NaN) and drew token 0 at 1e-30 and 1e-10."""
    drawn = np.concatenate([_draws(LOGITS, temperature, seed=seed, rows=8) for seed in range(4)])
    assert set(drawn.tolist()) == {int(np.argmax(LOGITS))}


def test_tiny_temperature_splits_exact_ties_between_the_tied_tokens():
    logits = LOGITS.copy()
    logits[8] = logits[7]  # tokens 7 and 8 tie for the max
    drawn = _draws(logits, 1e-30)
    assert set(drawn.tolist()) == {7, 8}
    assert abs(np.mean(drawn == 7) - 0.5) <= 5 * np.sqrt(0.25 / DRAWS)  # 5 sigma of a fair coin


@pytest.mark.parametrize("temperature", [0.5, 1.0, 7.0, 1e3])
def test_moderate_and_huge_temperatures_follow_the_softmax(temperature):
    """Empirical frequencies of DRAWS draws vs softmax(logits / T) in float64, per token within 5
    binomial standard deviations (plus 1e-6 for the float32 softmax): a false failure has odds
    below 12 * 6e-7."""
    z = LOGITS.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    freq = np.bincount(_draws(LOGITS, temperature, seed=1), minlength=LOGITS.size) / DRAWS
    bound = 5 * np.sqrt(p * (1 - p) / DRAWS) + 1e-6
    assert np.all(np.abs(freq - p) <= bound), (freq, p)
    if temperature == 1e3:
        assert np.count_nonzero(freq) == LOGITS.size  # near-uniform: every token drawn


def test_top_p_keeps_the_nucleus_only():
    """At T = 1 the two top tokens (7, 8) hold 0.9995 of the mass: top_p 0.7 keeps token 7 only
    (0.731 >= 0.7), top_p 0.9 keeps both, in their renormalised proportion e : 1."""
    assert set(_draws(LOGITS, 1.0, top_p=0.7).tolist()) == {7}
    drawn = _draws(LOGITS, 1.0, top_p=0.9, seed=2)
    assert set(drawn.tolist()) == {7, 8}
    p7 = np.e / (np.e + 1)
    assert abs(np.mean(drawn == 7) - p7) <= 5 * np.sqrt(p7 * (1 - p7) / DRAWS)


def test_generate_at_a_tiny_temperature_is_greedy():
    config = PRESETS["test-tiny"]
    params = wise_jax.from_checkpoint_tensors(config, random_tensors(config, seed=1, std=0.08))
    run = functools.partial(wise_jax.generate, params, config, [[5, 17, 99, 3]], max_new_tokens=4,
                            eos_token_id=None, page_size=32)
    assert run(temperature=1e-10).tokens == run(temperature=0.0).tokens


def test_min_p_then_top_k_then_top_p_restrict_the_draws():
    """The filters of SamplingParams, in their order, on the row wise_torch's sampler test uses:
    softmax 0.030 0.082 0.222 0.011 0.050 0.605."""
    row = np.array([0.0, 1.0, 2.0, -1.0, 0.5, 3.0], np.float32)
    batch = jnp.broadcast_to(jnp.asarray(row), (2000, 6))

    def drawn(top_p=1.0, top_k=0, min_p=0.0):
        return set(np.asarray(_sample(batch, jax.random.PRNGKey(4), jnp.float32(1.0), jnp.float32(top_p),
                                      jnp.int32(top_k), jnp.float32(min_p))).tolist())
    assert drawn() == set(range(6))
    assert drawn(top_p=0.6) == {5} and drawn(top_p=0.7) == {5, 2}
    assert drawn(top_k=3) == {5, 2, 1} and drawn(top_k=1) == {5}
    assert drawn(min_p=0.3) == {5, 2} and drawn(min_p=1.0) == {5}
    assert drawn(min_p=0.05) == {5, 2, 1, 4} and drawn(min_p=0.05, top_k=3, top_p=0.8) == {5, 2}
    tied = np.array([1.0, 3.0, 3.0, 0.0], np.float32)            # top_k 1 of a tie: the lower id
    assert set(np.asarray(_sample(jnp.broadcast_to(jnp.asarray(tied), (500, 4)), jax.random.PRNGKey(1),
                                  jnp.float32(1.0), jnp.float32(1.0), jnp.int32(1),
                                  jnp.float32(0.0))).tolist()) == {1}
