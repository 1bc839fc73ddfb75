"""How each decode row picks its token in the JAX engine: the per-row draw (key, sampling
parameters, forced token) and logits processing gathered on the host, and the on-device choice
(`wise_torch.engine.sampler` is torch's)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from wise_core.engine.sequence import Sequence
from wise_core.sampling_params import MAX_LOGPROBS
from wise_jax.sampling import LogitsState, process_logits, ranked, sample


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["keys", "index", "temperature", "top_p", "top_k", "min_p", "forced"], meta_fields=[])
@dataclasses.dataclass
class Draw:
    """How each row picks its token: keys uint32[rows, 2] (the request's key), index int32[rows]
    (the token's index in its sequence, folded into the key), temperature, top_p, min_p float32,
    top_k int32 (SamplingParams), forced int32 (the token to take instead, -1: none)."""

    keys: jax.Array
    index: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    forced: jax.Array

    @classmethod
    def spec(cls, rows: int) -> "Draw":
        """The abstract Draw of `rows` rows, to compile a program ahead."""
        f32, i32 = (jax.ShapeDtypeStruct((rows,), t) for t in (jnp.float32, jnp.int32))
        return cls(jax.ShapeDtypeStruct((rows, 2), jnp.uint32), i32, f32, f32, i32, f32, i32)


def draw_of(seqs: list[Sequence | None]) -> Draw:
    """The Draw of rows `seqs` (None: a padding row), on the host, for their next token."""
    rows = len(seqs)
    keys, index = np.zeros((rows, 2), np.uint32), np.zeros(rows, np.int32)
    temperature, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
    top_k, min_p, forced = np.zeros(rows, np.int32), np.zeros(rows, np.float32), np.full(rows, -1, np.int32)
    for row, seq in enumerate(seqs):
        if seq is None:
            continue
        p = seq.params
        keys[row], index[row] = seq.generator, len(seq.tokens)
        temperature[row], top_p[row], top_k[row], min_p[row] = p.temperature, p.top_p, p.top_k, p.min_p
        if seq.forced is not None:
            forced[row] = seq.forced[seq.num_generated]
    return Draw(keys, index, temperature, top_p, top_k, min_p, forced)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["active", "min_active", "repetition", "presence", "frequency"], meta_fields=[])
@dataclasses.dataclass
class Processing:
    """The logits processing of each row, in a step where some row is processed or asks for
    logprobs: active bool[rows] (SamplingParams.processed, not forced), min_active bool[rows]
    (fewer than min_tokens made), repetition, presence, frequency float32[rows] (its penalties)."""

    active: jax.Array
    min_active: jax.Array
    repetition: jax.Array
    presence: jax.Array
    frequency: jax.Array

    @classmethod
    def spec(cls, rows: int) -> "Processing":
        """The abstract Processing of `rows` rows, to compile a program ahead."""
        flag, f32 = jax.ShapeDtypeStruct((rows,), jnp.bool_), jax.ShapeDtypeStruct((rows,), jnp.float32)
        return cls(flag, flag, f32, f32, f32)


def processing_of(seqs: list[Sequence | None]) -> Processing:
    """The Processing of rows `seqs` (None: a padding row), on the host, for their next token."""
    rows = len(seqs)
    active, min_active = np.zeros(rows, bool), np.zeros(rows, bool)
    repetition, presence, frequency = np.ones(rows, np.float32), np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    for row, seq in enumerate(seqs):
        if seq is None or seq.forced is not None or not seq.params.processed:
            continue
        p = seq.params
        active[row], min_active[row] = True, seq.num_generated < p.min_tokens
        repetition[row], presence[row], frequency[row] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
    return Processing(active, min_active, repetition, presence, frequency)


def choose(logits, draw: Draw, processing: Processing | None = None, state: LogitsState | None = None, *,
            sampling: bool):
    """Per row: the forced token where forced >= 0, else a sample (greedy where temperature is 0;
    with sampling=False every row is greedy and no sampling code runs) with the row's key
    folded with its index, of the logits processed where `processing` says (state: the rows'
    LogitsState). Returns (token int32[rows], its log-prob float32[rows] under the raw logits,
    ranked: None without processing, else (rank, top ids, top log p) of `ranked`)."""
    chosen_from = logits
    if processing is not None:   # a step with no processed row and no logprobs asked never runs this
        p = processing
        processed = process_logits(logits, state.prompt, state.counts, state.bias, state.stops, p.min_active,
                                   p.repetition, p.presence, p.frequency)
        chosen_from = jnp.where(p.active[:, None], processed, logits)
    if sampling:
        keys = jax.vmap(jax.random.fold_in)(draw.keys, draw.index)
        sampled = jax.vmap(lambda l, k, t, p, tk, mp: sample(l[None], k, t, p, tk, mp)[0])(
            chosen_from, keys, draw.temperature, draw.top_p, draw.top_k, draw.min_p)
    else:
        sampled = jnp.argmax(chosen_from, axis=-1).astype(jnp.int32)
    token = jnp.where(draw.forced >= 0, draw.forced, sampled)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=1)[:, 0]
    top = None if processing is None else ranked(logits, token, min(MAX_LOGPROBS, logits.shape[-1]))[1:]
    return token, logprob, top


def counted(state: LogitsState, slots, token, active) -> LogitsState:
    """state with each active row's token (slots, token, active [rows]) added to its slot's counts."""
    return dataclasses.replace(state, counts=state.counts.at[slots, token].add(active.astype(jnp.int32)))
