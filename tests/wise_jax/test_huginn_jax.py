"""wise_jax.huginn: the Huginn forward in JAX against wise_core.huginn_reference on a random
HF-layout checkpoint."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from huginn_cases import TINY, bound, checkpoint
from wise_core.checkpoint import random_tensors
from wise_core.huginn_reference import HuginnCache, huginn_forward, huginn_weights, initial_state, num_planes
from wise_core.presets import PRESETS
from wise_jax import kv_cache as kvc
from wise_jax.huginn import decode_step, forward, huginn_from_tensors, prefill, split_half_rows
from wise_jax.loading import params_from_tensors


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
    ids = np.random.default_rng(4).integers(0, TINY.vocab_size, (2, 10)).astype(np.int32)  # compiled above
    state = np.random.default_rng(5).normal(size=(2, 10, TINY.hidden_size))
    got = np.asarray(forward(params, TINY, ids, num_steps=2, state=state), np.float64)[1]
    want = huginn_forward(TINY, huginn_weights(TINY, ckpt.tensors), ids[1], num_steps=2, state=state[1])
    assert np.abs(got - want).max() <= bound(TINY, 2, want, 10)
    with pytest.raises(ValueError, match=r"state must be \[2, 10, 128\]"):
        forward(params, TINY, ids, state=np.zeros((10, 128)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        forward(params, TINY, jnp.array([[384]], jnp.int32))
    with pytest.raises(ValueError, match="num_steps must be a non-negative integer"):
        forward(params, TINY, ids, num_steps=-1)


def test_split_half_rows():
    w = np.arange(16.0)[:, None]
    assert split_half_rows(w, 2, 8)[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


def test_prefill_and_decode_match_reference(tmp_path):
    """Prefill of 37 tokens padded to two pages of 32, inserted into a cache with planes for 6
    iterations (4 run), then 3 dense decode steps: each call's logits equal the reference's
    cached forward within rounding."""
    ckpt = checkpoint(tmp_path)
    params, weights = huginn_from_tensors(TINY, ckpt.tensors), huginn_weights(TINY, ckpt.tensors)
    ids = np.random.default_rng(6).integers(0, TINY.vocab_size, 40).astype(np.int32)
    spec = HuginnCache()
    padded = np.zeros(64, np.int32)
    padded[:37] = ids[:37]
    logits, k, v = prefill(params, TINY, jnp.asarray(padded), jnp.int32(37),
                           jnp.asarray(initial_state(TINY, np.arange(64), 9), jnp.float32), num_steps=4)
    want = huginn_forward(TINY, weights, ids[:37], num_steps=4, cache=spec, seed=9)[-1]
    assert k.shape == (num_planes(TINY, 4), 64, 2, 64)
    assert np.abs(np.asarray(logits, np.float64) - want).max() <= bound(TINY, 4, want, 37)
    cache = kvc.create(TINY, batch=1, max_pages=2, num_pages=3, page_size=32, planes=num_planes(TINY, 6))
    planes = num_planes(TINY, 6) - num_planes(TINY, 4)
    pad = jnp.zeros((planes,) + k.shape[1:], k.dtype)
    cache = jax.jit(kvc.insert)(cache, jnp.concatenate([k, pad]), jnp.concatenate([v, pad]), jnp.int32(37),
                                jnp.int32(0))
    for pos in range(37, 40):
        state = jnp.asarray(initial_state(TINY, [pos], 9), jnp.float32)
        logits, cache, _ = decode_step(params, TINY, cache, jnp.asarray(ids[pos:pos + 1]), state,
                                       jnp.zeros(1, jnp.int32), num_steps=4, kernel="reference")
        want = huginn_forward(TINY, weights, ids[pos:pos + 1], num_steps=4, cache=spec, seed=9)
        assert np.abs(np.asarray(logits, np.float64) - want).max() <= bound(TINY, 4, want, pos + 1), pos
    with pytest.raises(ValueError, match="the cache holds 21 planes; 7 core iterations need 24"):
        decode_step(params, TINY, cache, jnp.asarray(ids[:1]), state, jnp.zeros(1, jnp.int32), num_steps=7)


def test_the_loader_builds_huginn_params_from_a_huginn_checkpoint(tmp_path):
    """`load_model` of a Huginn checkpoint directory (and `from_checkpoint_tensors` of a Huginn
    config) gives the HuginnParams of its tensors, bitwise; the engine refuses Ouro params with a
    Huginn config, and the Ouro params builder a Huginn config, naming them."""
    ckpt = checkpoint(tmp_path)
    want = huginn_from_tensors(TINY, ckpt.tensors)
    config, params = wise_jax.load_model(tmp_path / "ckpt")
    assert config == TINY
    for got in (params, wise_jax.from_checkpoint_tensors(TINY, ckpt.tensors)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ouro = wise_jax.from_checkpoint_tensors(PRESETS["test-tiny"], random_tensors(PRESETS["test-tiny"], seed=0))
    with pytest.raises(TypeError, match="a Huginn config takes HuginnParams"):
        wise_jax.LLM(ouro, TINY, num_pages=4, page_size=32)
    with pytest.raises(ValueError, match="Ouro params take architecture 'ouro', got 'huginn'"):
        params_from_tensors(TINY, {}, jnp.float32)
