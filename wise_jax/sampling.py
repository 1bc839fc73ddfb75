"""Next-token choice under jit: logits processing (logit_bias, min_tokens, penalties), then
greedy, or temperature with min-p, top-k and top-p (nucleus) filtering; the logprobs reported."""

from __future__ import annotations

import dataclasses
import functools

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


def process_logits(logits: jax.Array, prompt: jax.Array, counts: jax.Array, bias: jax.Array, stops: jax.Array,
                   min_active: jax.Array, repetition: jax.Array, presence: jax.Array, frequency: jax.Array
                   ) -> jax.Array:
    """The logits processing of `SamplingParams`, before temperature, in vLLM's order: logits
    float32[rows, vocab]; per row the request's logits state (prompt bool[rows, vocab]: in its
    prompt; counts int32[rows, vocab]: in its output; bias float32[rows, vocab]: logit_bias;
    stops bool[rows, vocab]: its stop ids), min_active bool[rows] (fewer than min_tokens made)
    and its penalties float32[rows] -> processed logits: bias added and the stop ids -inf where
    min_active; then the repetition penalty over the prompt's and the output's tokens (positive
    logits divided, negative multiplied), then frequency x count + presence x (count > 0)
    subtracted. Every parameter is traced: no value recompiles."""
    z = jnp.where(min_active[:, None] & stops, -jnp.inf, logits + bias)
    seen = prompt | (counts > 0)
    r = repetition[:, None]
    z = jnp.where(seen, jnp.where(z > 0, z / r, z * r), z)
    return z - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def ranked(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits float32[rows, vocab], tokens int32[rows] -> (log p of the tokens float32[rows];
    rank int32[rows]: the tokens at least as probable as the row's, itself included (1: the most
    probable); top ids int32[rows, k] and their log p float32[rows, k], most probable first, ties
    to the lower id), under log_softmax(logits)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=1)
    rank = jnp.sum(logp >= chosen, axis=-1, dtype=jnp.int32)
    values, ids = lax.top_k(logp, k)
    return chosen[:, 0], rank, ids.astype(jnp.int32), values


@functools.partial(jax.tree_util.register_dataclass, data_fields=["prompt", "counts", "bias", "stops"],
                   meta_fields=[])
@dataclasses.dataclass
class LogitsState:
    """Per sequence slot, what `process_logits` needs of a processed request
    (`SamplingParams.processed`): prompt bool, counts int32, bias float32 and stops bool
    [slots, vocab] (`wise_core.engine.sequence.logits_rows`), written from the host when a
    processed request first samples in a slot, its counts then grown on the device by each
    token sampled."""

    prompt: jax.Array
    counts: jax.Array
    bias: jax.Array
    stops: jax.Array

    @classmethod
    def create(cls, slots: int, vocab_size: int) -> "LogitsState":
        shape = (slots, vocab_size)
        return cls(jnp.zeros(shape, bool), jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32),
                   jnp.zeros(shape, bool))

    def rows(self, index) -> "LogitsState":
        """The state of slots `index` (an int32 array)."""
        return jax.tree.map(lambda x: x[index], self)
