"""Next-token choice under jit: greedy, or temperature with top-p (nucleus) filtering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from wise_jax.attention import select_blocks


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array = 0,
           min_p: jax.Array = 0.0) -> jax.Array:
    """logits float32[batch, vocab] -> int32[batch].

    temperature == 0: argmax (ties to the lower id). Otherwise sample softmax(logits / temperature)
    restricted, in this order, to the tokens of probability >= min_p x the largest, to the
    top_k most probable (0: all; ties to the lower id), and to the smallest prefix of what is
    left, ranked by probability, that reaches top_p (the WISE selection rule; as wise_torch and
    `SamplingParams`). Works in log space: (logits - max) / temperature is <= 0 and never
    overflows, so any positive temperature (1e-30 included) is well defined; as it goes to 0 the
    choice becomes greedy. temperature, top_p, top_k and min_p are traced scalars: changing them
    does not recompile.
    """
    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic():
        scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature  # <= 0, -inf at most
        p = jnp.exp(jax.nn.log_softmax(scaled, axis=-1))
        scaled = jnp.where(p >= min_p * jnp.max(p, axis=-1, keepdims=True), scaled, -jnp.inf)
        rank = jnp.argsort(jnp.argsort(-scaled, axis=-1, stable=True), axis=-1)    # 0: the most probable
        scaled = jnp.where((top_k <= 0) | (rank < top_k), scaled, -jnp.inf)
        kept = select_blocks(jnp.exp(jax.nn.log_softmax(scaled, axis=-1)), top_p)
        return jax.random.categorical(key, jnp.where(kept, scaled, -jnp.inf), axis=-1).astype(jnp.int32)

    return lax.cond(temperature > 0, stochastic, greedy)
