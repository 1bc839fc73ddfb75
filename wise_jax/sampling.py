"""Next-token choice under jit: greedy, or temperature with top-p (nucleus) filtering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits float32[batch, vocab] -> int32[batch].

    temperature == 0: argmax (ties to the lower id). Otherwise sample softmax(logits / temperature)
    restricted to the smallest set of most likely tokens whose probability reaches top_p (ties at
    the cut are kept). temperature and top_p are traced scalars, so changing them does not recompile.
    """
    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic():
        scaled = logits / temperature
        ranked = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = ((before < top_p) | (top_p >= 1.0)).sum(-1, keepdims=True)
        cutoff = jnp.take_along_axis(ranked, kept - 1, axis=-1)
        filtered = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
        return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)

    return lax.cond(temperature > 0, stochastic, greedy)
