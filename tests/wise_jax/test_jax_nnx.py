"""wise_jax.nnx.Ouro: conversion with Params is exact both ways, the forward is the functional
forward bitwise, and a few fine-tuning steps with nnx.Optimizer + optax lower the loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from wise_core.model_config import ModelConfig
from wise_jax import model as wm
from wise_jax import train as T
from wise_jax.nnx import Ouro
from wise_jax.params import init_params, unstack_layers

CONFIG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, rope_theta=10_000.0, max_position_embeddings=128, total_ut_steps=2)


def bits(tree):
    return [np.asarray(x).view(np.uint32 if x.dtype == jnp.float32 else np.uint16) for x in jax.tree.leaves(tree)]


def same_bits(a, b) -> bool:
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(np.array_equal(x, y) for x, y in zip(bits(a), bits(b))))


@pytest.mark.parametrize("tied", [False, True])
def test_conversion_is_exact_both_ways(tied):
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    params = init_params(config, jax.random.PRNGKey(0))
    assert (params.lm_head is None) == tied
    module = Ouro.from_params(params, config)
    assert same_bits(module.to_params(), params)
    # and back through the module's own state: a fresh module from to_params holds the same values
    again = Ouro.from_params(module.to_params(), config)
    assert same_bits(nnx.state(again, nnx.Param), nnx.state(module, nnx.Param))
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert same_bits(Ouro.from_params(bf16, config).to_params(), bf16)


def test_forward_equals_the_functional_forward_bitwise():
    """Each under jit (eager dispatch of the scanned layers is slow on CI): the module under
    nnx.jit, the functional model under jax.jit."""
    params = init_params(CONFIG, jax.random.PRNGKey(1))
    module = Ouro.from_params(params, CONFIG)
    ids = jax.random.randint(jax.random.PRNGKey(2), (2, 24), 0, CONFIG.vocab_size, jnp.int32)
    tokens = jnp.concatenate([ids, ids[:, :1]], axis=1)

    @nnx.jit
    def of_module(m, ids, tokens):
        return m(ids), m.forward_with_exits(ids), m.loop_losses(tokens)

    @jax.jit
    def functional(params, ids, tokens):
        return (wm.forward(params, CONFIG, ids), wm.forward_with_exits(params, CONFIG, ids),
                T.loop_losses(params, CONFIG, tokens))

    got, want = of_module(module, ids, tokens), functional(params, ids, tokens)
    assert same_bits(got, want)
    assert not same_bits(got[1][1], jnp.zeros_like(got[1][1]))  # compared something non-trivial


def test_rngs_init_is_init_params():
    module = Ouro(CONFIG, rngs=nnx.Rngs(params=3))
    assert same_bits(module.to_params(), init_params(CONFIG, nnx.Rngs(params=3).params()))


def test_bad_arguments_raise():
    params = init_params(CONFIG, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="either params"):
        Ouro(CONFIG)
    with pytest.raises(ValueError, match="either params"):
        Ouro(CONFIG, params, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="ModelConfig"):
        Ouro.from_params(params, {"vocab_size": 64})
    with pytest.raises(TypeError, match="Params"):
        Ouro.from_params({"embed_tokens": params.embed_tokens}, CONFIG)
    with pytest.raises(ValueError, match="stacked layers"):
        Ouro.from_params(unstack_layers(params), CONFIG)


def test_fine_tuning_with_nnx_optimizer_lowers_the_loss():
    module = Ouro(CONFIG, rngs=nnx.Rngs(0))
    before = module.to_params()
    optimizer = nnx.Optimizer(module, optax.adamw(3e-3), wrt=nnx.Param)
    tokens = jnp.tile(jnp.arange(17, dtype=jnp.int32) % 8, (4, 1))  # a learnable periodic stream

    def loss_fn(model):
        ce, p = model.loop_losses(tokens)
        return T.ouro_objective(ce, p, beta=0.05)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(module, optimizer)) for _ in range(8)]
    assert losses[-1] < 0.8 * losses[0], losses
    assert not same_bits(module.to_params(), before)  # the module's own params moved
