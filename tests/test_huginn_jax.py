"""wise_jax.huginn: the Huginn forward in JAX against wise_core.huginn_reference on a random
HF-layout checkpoint."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from wise_core import rounding
from wise_core.checkpoint import Checkpoint, load_checkpoint, random_tensors, save_checkpoint
from wise_core.config import PRESETS
from wise_core.huginn_reference import huginn_forward, huginn_weights
from wise_jax.huginn import forward, huginn_from_tensors, split_half_rows

TINY = PRESETS["test-tiny-huginn"]


def checkpoint(tmp_path, config=TINY):
    tensors = random_tensors(config, seed=0, std=0.08)
    rng = np.random.default_rng(1)
    tensors = {k: v + np.float32(0.1) * rng.normal(size=v.shape).astype(np.float32) if "norm" in k else v
               for k, v in tensors.items()}  # norm weights off 1
    save_checkpoint(tmp_path / "ckpt", Checkpoint(config, tensors))
    return load_checkpoint(tmp_path / "ckpt")


def bound(config, num_steps, want, keys):
    """`rounding.network_bound` of a float32 run against the float64 spec over the model's depth
    (prelude + core * steps + coda sublayers) and its longest reduction."""
    depth = config.n_layers_in_prelude + config.n_layers_in_recurrent_block * num_steps + config.n_layers_in_coda
    width = max(2 * config.hidden_size, config.intermediate_size, keys)
    return rounding.network_bound(scale=float(np.abs(want).max()), depth=depth, width=width)


@pytest.mark.parametrize("qk_bias, tied", [(True, True), (False, False)])
def test_forward_matches_reference(tmp_path, qk_bias, tied):
    config = dataclasses.replace(TINY, qk_bias=qk_bias, tie_word_embeddings=tied)
    ckpt = checkpoint(tmp_path, config)
    params = huginn_from_tensors(config, ckpt.tensors)
    ids = np.random.default_rng(2).integers(0, config.vocab_size, (2, 10)).astype(np.int32)
    weights = huginn_weights(config, ckpt.tensors)
    for steps in (5, 0):
        got = np.asarray(forward(params, config, ids, num_steps=steps, seed=3), np.float64)
        for row in range(2):
            want = huginn_forward(config, weights, ids[row], num_steps=steps, seed=3)
            assert np.abs(got[row] - want).max() <= bound(config, steps, want, 10), steps


def test_explicit_state_and_errors(tmp_path):
    ckpt = checkpoint(tmp_path)
    params = huginn_from_tensors(TINY, ckpt.tensors)
    ids = np.random.default_rng(4).integers(0, TINY.vocab_size, (1, 6)).astype(np.int32)
    state = np.random.default_rng(5).normal(size=(1, 6, TINY.hidden_size))
    got = np.asarray(forward(params, TINY, ids, num_steps=2, state=state), np.float64)[0]
    want = huginn_forward(TINY, huginn_weights(TINY, ckpt.tensors), ids[0], num_steps=2, state=state[0])
    assert np.abs(got - want).max() <= bound(TINY, 2, want, 6)
    with pytest.raises(ValueError, match=r"state must be \[1, 6, 128\]"):
        forward(params, TINY, ids, state=np.zeros((6, 128)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        forward(params, TINY, jnp.array([[384]], jnp.int32))
    with pytest.raises(ValueError, match="num_steps must be a non-negative integer"):
        forward(params, TINY, ids, num_steps=-1)


def test_split_half_rows():
    w = np.arange(16.0)[:, None]
    assert split_half_rows(w, 2, 8)[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
