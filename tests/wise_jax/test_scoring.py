"""wise_jax.score / greedy: the jittable forced decode gives the engine's teacher_force log-probs
bitwise in float32 (dense and WISE, with its density and fallbacks), greedy gives generate's
tokens, an equal WiseConfig reuses the compiled decode, gradients through it are finite and
descend, and bad arguments are named errors. A 1-layer variant of test-tiny keeps the compiles
short."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_jax import scoring

CONFIG = dataclasses.replace(PRESETS["test-tiny"], num_hidden_layers=1)
PAGE = 32
# Two contexts of 2 pages and 1 (each prefilled at its own whole pages, as the engine does), 12
# forced tokens: every decode step of the engine runs at one context bucket (2 pages).
CONTEXTS, FORCED = (40, 20), 12


@pytest.fixture(scope="module")
def params():
    return wise_jax.from_checkpoint_tensors(CONFIG, random_tensors(CONFIG, seed=3, std=0.08))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    contexts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in CONTEXTS]
    forced = rng.integers(0, CONFIG.vocab_size, (len(CONTEXTS), FORCED)).tolist()
    padded = np.zeros((len(CONTEXTS), max(CONTEXTS)), np.int32)
    for row, context in enumerate(contexts):
        padded[row, :len(context)] = context
    return contexts, forced, padded


@pytest.mark.parametrize("wise_config", [None, WiseConfig(eta=0.5)], ids=["dense", "wise"])
def test_score_is_teacher_force_bitwise(params, data, wise_config):
    contexts, forced, padded = data
    engine = wise_jax.teacher_force(params, CONFIG, contexts, forced, wise_config=wise_config, page_size=PAGE)
    before = scoring.TRACES["score"]
    out = wise_jax.score(params, CONFIG, padded, np.asarray(forced), wise_config, context_lengths=list(CONTEXTS),
                         page_size=PAGE)
    for row in range(len(CONTEXTS)):   # the engine's computations at its shapes: equal bits
        np.testing.assert_array_equal(np.asarray(out.logprobs)[row], engine.logprobs[row])
    assert np.asarray(out.tokens).tolist() == forced
    if wise_config is None:
        assert out.density() is None and engine.stats.density is None
    else:
        assert dict(zip(wise_config.reuse_depths, np.asarray(out.density()).tolist())) == engine.stats.density
        assert int(out.fallbacks) == engine.stats.fallbacks == 0
        steps = np.asarray(out.step_selected).sum(0), np.asarray(out.step_causal).sum(0)
        np.testing.assert_array_equal(steps[0], out.selected_blocks)   # integer counts, exact in float32
        np.testing.assert_array_equal(steps[1], out.causal_blocks)
        density = np.asarray(out.step_density())
        assert density.shape == (FORCED - 1, 2) and ((density > 0) & (density <= 1)).all()
        assert density.min() < 1                                         # eta 0.5 leaves blocks out
        # An equal WiseConfig (a new object) reuses the compiled decode.
        again = wise_jax.score(params, CONFIG, padded, np.asarray(forced), WiseConfig(eta=0.5),
                               context_lengths=list(CONTEXTS), page_size=PAGE)
        np.testing.assert_array_equal(np.asarray(again.logprobs), np.asarray(out.logprobs))
    assert scoring.TRACES["score"] == before + 1


def test_greedy_gives_the_tokens_of_generate(params, data):
    contexts, _, padded = data
    wise_config = WiseConfig(eta=0.5)
    engine = wise_jax.generate(params, CONFIG, contexts, max_new_tokens=6, eos_token_id=None, wise_config=wise_config,
                               page_size=PAGE)
    out = wise_jax.greedy(params, CONFIG, padded, 6, wise_config, context_lengths=list(CONTEXTS), page_size=PAGE)
    assert np.asarray(out.tokens).tolist() == engine.tokens
    assert np.isfinite(np.asarray(out.logprobs)).all() and (np.asarray(out.logprobs) <= 0).all()


def test_gradients_through_score_are_finite_and_descend(params, data):
    """Under WISE, through the scan, the prefill and both a discovery and a reuse loop's
    attention (2 loops: half the compile of 4)."""
    contexts, forced, _ = data
    context, continuation = jnp.asarray(contexts[0][:20]), jnp.asarray(forced[0][:6])
    config = dataclasses.replace(CONFIG, total_ut_steps=2)
    wise_config = WiseConfig(eta=0.5, discover_depths=(0,), reuse_depths=(1,))

    def loss(params):
        return -wise_jax.score(params, config, context, continuation, wise_config, page_size=PAGE).logprobs.mean()

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    value, grads = value_and_grad(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads.layers.qkv_proj).max()) > 0 and float(jnp.abs(grads.embed_tokens).max()) > 0
    stepped = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    assert float(value_and_grad(stepped)[0]) < float(value)               # a descent direction


@pytest.mark.parametrize("call,match", [
    (lambda p: wise_jax.score(p, CONFIG, [[1, 2]], [[3], [4]]), "context_ids hold 1 rows, continuation_ids 2"),
    (lambda p: wise_jax.score(p, CONFIG, np.zeros((1, 2, 2), np.int32), [3]), r"context_ids must be .*int32\[1, 2, 2\]"),
    (lambda p: wise_jax.score(p, CONFIG, [1, 2], []), "continuation_ids must be non-empty integer token ids"),
    (lambda p: wise_jax.score(p, CONFIG, [1, 400], [3]), r"ids \[400\] outside the vocabulary"),
    (lambda p: wise_jax.score(p, CONFIG, [1, 2], [3], context_lengths=[3]), r"context_lengths must be in \[1, 2\]"),
    (lambda p: wise_jax.score(p, CONFIG, [1] * 1000, [3] * 30), "exceed max_position_embeddings"),
    (lambda p: wise_jax.score(p, CONFIG, [1, 2], [3], WiseConfig(reuse_depths=(2, 7))), r"wise_config depths \[7\]"),
    (lambda p: wise_jax.score(p, dataclasses.replace(CONFIG, hidden_size=64), [1, 2], [3]), "params.embed_tokens"),
    (lambda p: wise_jax.greedy(p, CONFIG, [1, 2], 0), "num_tokens must be a positive integer"),
])
def test_bad_arguments_are_named(params, call, match):
    with pytest.raises(ValueError, match=match):
        call(params)
