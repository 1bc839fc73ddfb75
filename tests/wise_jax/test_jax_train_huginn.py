"""wise_jax.train on Huginn (objective "huginn"): the sampled recurrence counts follow the released
"poisson-lognormal-filling" draw, only the last `grad` core iterations get gradient, the
training forward is `wise_jax.huginn.forward`'s, a few steps lower the loss on a tiny stream, and
the trained params go back to the HF layout bit for bit."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from huginn_cases import bound
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.train_config import TrainConfig
from wise_jax import huginn as hg
from wise_jax import train as T

TINY = dataclasses.replace(PRESETS["test-tiny-huginn"], vocab_size=64, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                           n_layers_in_prelude=1, n_layers_in_recurrent_block=2, n_layers_in_coda=1)
TRAIN = TrainConfig(objective="huginn", backprop_depth=2, batch=4, seq_len=32, max_steps=12, warmup=2, lr=3e-3,
                    compute_dtype="float32")


def tiny_params(seed=0):
    tensors = random_tensors(TINY, seed=seed, std=0.08)
    return hg.huginn_from_tensors(TINY, tensors, jnp.float32), tensors


def tokens_and_state(seq=16, batch=2):
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (batch, seq + 1)), jnp.int32)
    return tokens, T.initial_states(TINY, jax.random.PRNGKey(1), (batch, seq))


def test_recurrence_counts_follow_the_released_draw():
    mean, backprop, n = 4, 2, 20_000
    free, grad = jax.vmap(lambda k: T.recurrence_counts(k, mean, backprop))(
        jax.random.split(jax.random.PRNGKey(0), n))
    free, grad = np.asarray(free), np.asarray(grad)
    total = free + grad
    assert total.min() >= 1
    np.testing.assert_array_equal(grad, np.minimum(total, backprop))
    np.testing.assert_array_equal(free, np.maximum(total - backprop, 0))
    # total = Poisson(rate) + 1, E[rate] = mean: E[total] = mean + 1; Var = mean + mean^2 (e^{sigma^2} - 1)
    # = 8.54, so the mean of 20,000 draws has standard error 0.021: 5 standard errors
    assert abs(total.mean() - (mean + 1)) < 5 * math.sqrt(8.54 / n), total.mean()
    assert (total > 2 * mean).any() and (total < mean).any()   # a spread, not a constant


def test_training_forward_is_the_model_forward():
    params, _ = tiny_params()
    tokens, state = tokens_and_state()
    ce = T.huginn_losses(params, TINY, tokens, state, jnp.int32(3), jnp.int32(2), 2)
    logits = hg.forward(params, TINY, tokens[:, :-1], num_steps=5, state=state)
    want = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
    # fp32, the same ops fused differently: the network bound over 1 + 2 x 5 + 1 layers
    assert float(jnp.abs(ce - want).max()) <= bound(TINY, 5, np.asarray(logits), keys=16)


def test_only_the_last_iterations_get_gradient():
    params, _ = tiny_params()
    tokens, state = tokens_and_state()

    @jax.jit
    def grads(p, s, free, grad):   # d loss / d (params, initial state); counts traced: one compile
        def loss(p, s):
            return jnp.mean(T.huginn_losses(p, TINY, tokens, s, free, grad, 2))
        return jax.grad(loss, argnums=(0, 1))(p, s)

    def run(s, free, grad):
        return grads(params, s, jnp.int32(free), jnp.int32(grad))

    assert float(jnp.abs(run(state, 0, 2)[1]).max()) > 0
    assert float(jnp.abs(run(state, 3, 2)[1]).max()) == 0       # the free iterations stop it
    assert float(jnp.abs(run(state, 0, 1)[1]).max()) > 0        # grad < max_grad: still from the state

    # no iteration with gradient: the core block, the adapter and the prelude get none, the coda some
    g, _ = run(state, 3, 0)
    zero = [g.adapter] + jax.tree.leaves(g.core_block) + jax.tree.leaves(g.prelude)
    assert all(float(jnp.abs(x).max()) == 0 for x in zero)
    assert float(jnp.abs(g.coda[0].mlp_proj).max()) > 0

    # (free 3, grad 2) from the initial state has the gradient of (free 0, grad 2) from the state
    # after 3 iterations: the free iterations add nothing to it
    embedded, iterate, _ = T.huginn_parts(params, TINY, tokens[:, :-1], T.dense_attend)
    after_3 = T.truncated_iterations(params, iterate, state, embedded, jnp.int32(3), jnp.int32(0), 0)
    got, want = run(state, 3, 2)[0], run(after_3, 0, 2)[0]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # fp32, one computation fused two ways (a while loop vs straight-line): relative 1e-4 of the leaf
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))


def test_a_few_steps_lower_the_loss():
    stream = np.tile(np.random.default_rng(0).integers(0, TINY.vocab_size, 61), 30)
    state, steps, _ = T.train_loop(TINY, TRAIN, stream, log=lambda _: None)
    losses = [s["loss"] for s in steps]
    assert int(state.step) == 12 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    assert all(1 <= s["depth"] and s["backprop"] == min(s["depth"], 2) for s in steps)
    assert len({s["depth"] for s in steps}) > 1                       # the depth is drawn per step


def test_params_go_back_to_the_checkpoint_layout_bitwise():
    params, tensors = tiny_params()
    back = hg.huginn_to_tensors(TINY, params)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)


def test_objective_must_match_the_architecture():
    with pytest.raises(ValueError, match="does not train a huginn model"):
        T.init_state(TINY, dataclasses.replace(TRAIN, objective="ouro"))
    with pytest.raises(ValueError, match="does not train a ouro model"):
        T.init_state(T.BUILTIN_MODEL, TRAIN)
    with pytest.raises(ValueError, match="backprop_depth must be a positive integer"):
        dataclasses.replace(TRAIN, backprop_depth=0)
