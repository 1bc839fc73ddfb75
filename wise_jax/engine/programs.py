"""The JAX engine's device programs: the decode step over a step plan's compacted rows, the
prefill step over a step's prompt chunks, the first tokens of prefilled prompts, logits-state
rows, page writes and reads (offload, restore, scrub) and prompt scores. Each is jit-compiled;
the decode step is compiled ahead per (variant, bucket) by `wise_jax.engine.compiler`."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.engine.step_plan import DecodePlan
from wise_core.model_config import ModelConfig
from wise_core.sampling_params import MAX_LOGPROBS
from wise_jax import huginn
from wise_jax import kv_cache as kvc
from wise_jax import sharding
from wise_jax.chunked_prefill import sharded_prefill_chunks
from wise_jax.params import Params
from wise_jax.sampling import LogitsState, ranked
from wise_jax.serving import TRACES
from wise_jax.engine.sampler import Draw, Processing, choose, counted


class StepVariant(NamedTuple):
    """A decode program's static options: sampling (some row samples; else every row is greedy
    and no sampling code runs), keep_logits (the logits come back), extras (some row processes
    logits or asks for ranked logprobs: `LLM._extras`)."""

    sampling: bool
    keep_logits: bool
    extras: bool


DEFAULT_VARIANT = StepVariant(sampling=False, keep_logits=False, extras=False)


class PrefillVariant(NamedTuple):
    """A prefill program's static options: attention (the prefill attention of chunks that all
    open their prompts; None: over the pages, `chunked_prefill.prefill_chunks`), all_logits
    (the logits of every position come back, for prompt scores)."""

    attention: str | None
    all_logits: bool


class FirstVariant(NamedTuple):
    """A first-token program's static options (`first_tokens`): sampling, extras (as StepVariant's)."""

    sampling: bool
    extras: bool


def spec_of(tree, mesh=None):
    """The abstract values (shape, dtype, sharding) of a pytree of arrays (or of abstract values).
    With a mesh, a leaf not laid out over it (a host array, one on a single device) is replicated
    on it: a program compiled ahead takes every argument on the mesh it runs on."""
    def spec(x):
        placed = getattr(x, "sharding", None)
        if mesh is not None and not isinstance(placed, NamedSharding):
            placed = NamedSharding(mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed)
    return jax.tree.map(spec, tree)


@functools.partial(jax.jit, static_argnames=("sampling",), donate_argnames=("next_token", "logits_state"))
def first_tokens(next_token, logits, slots, draw: Draw, processing: Processing | None = None,
                 logits_state: LogitsState | None = None, *, sampling: bool):
    """choose for the rows of a prefill step (logits float32[rows, vocab], draw of the rows); a
    row whose prompt completes (slots int32[rows]: its sequence slot; -1: no token) is noted as
    its slot's next decode input -> (next_token, logits_state, (token, logprob, NaN flag, ranked)),
    per row."""
    TRACES["first_tokens"] += 1
    sampled = slots >= 0
    slot = jnp.maximum(slots, 0)
    rows = None if logits_state is None else logits_state.rows(slot)
    token, logprob, top = choose(logits, draw, processing, rows, sampling=sampling)
    if logits_state is not None:
        logits_state = counted(logits_state, slot, token, processing.active & sampled)
    written = jnp.where(sampled, slots, next_token.shape[0])      # rows with no token write nothing
    return (next_token.at[written].set(token, mode="drop"), logits_state,
            (token, logprob, jnp.isnan(logprob), top))


@functools.partial(jax.jit, donate_argnames=("state",))
def set_logits_rows(state: LogitsState, slot, prompt, counts, bias, stops) -> LogitsState:
    """state with slot's rows set (`wise_core.engine.sequence.logits_rows`)."""
    TRACES["set_logits_rows"] += 1
    return LogitsState(state.prompt.at[slot].set(prompt), state.counts.at[slot].set(counts),
                       state.bias.at[slot].set(bias), state.stops.at[slot].set(stops))


@functools.partial(jax.jit, donate_argnames=("cache",))
def write_pages(cache: kvc.PagedKVCache, k, v, pages) -> kvc.PagedKVCache:
    """Write K/V values k, v [planes, len(pages), page_size, kv_heads, head_dim] into storage
    `pages` (quantized for an fp8 cache, `kv_cache.store`)."""
    TRACES["write_pages"] += 1
    return kvc.store(cache, (slice(None), pages), k, v)


@jax.jit
def read_pages(cache: kvc.PagedKVCache, pages) -> tuple:
    """The storage of `pages`, as the cache holds it (`kv_cache.read_pages`): k, v [planes,
    len(pages), page_size, kv_heads, head_dim], and an fp8 cache's scales [planes, len(pages),
    page_size, kv_heads]."""
    return kvc.read_pages(cache, pages)


@functools.partial(jax.jit, donate_argnames=("cache",))
def restore_pages(cache: kvc.PagedKVCache, stored: tuple, pages) -> kvc.PagedKVCache:
    """`read_pages`' tuple written back, as it is, into storage `pages` (`kv_cache.write_pages`)."""
    TRACES["restore_pages"] += 1
    return kvc.write_pages(cache, pages, stored)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tokens", "starts", "lengths", "tables"],
                   meta_fields=[])
@dataclasses.dataclass
class Chunks:
    """A prefill step's prompt chunks, a row each (`chunked_prefill.prefill_chunks`): tokens
    int32[rows, seq] (row r valid up to lengths[r]), starts, lengths int32[rows] (a padding row:
    length 0), tables int32[rows, width] (each row's pages; the scratch page past them)."""

    tokens: jax.Array
    starts: jax.Array
    lengths: jax.Array
    tables: jax.Array

    @classmethod
    def of(cls, chunks: list, *, rows: int, seq: int, width: int, page_size: int, scratch_page: int,
           pad_id: int) -> "Chunks":
        """The (rows, seq, width) bucket's arrays of `chunks` (`wise_core.engine.Chunk`s, each
        within seq tokens and width pages), on the host."""
        tokens = np.full((rows, seq), pad_id, np.int32)
        starts, lengths = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        tables = np.full((rows, width), scratch_page, np.int32)
        for r, chunk in enumerate(chunks):
            tokens[r, :chunk.length] = chunk.seq.prompt[chunk.start:chunk.start + chunk.length]
            starts[r], lengths[r] = chunk.start, chunk.length
            pages = chunk.seq.pages[:-(-(chunk.start + chunk.length) // page_size)]
            tables[r, :len(pages)] = pages
        return cls(tokens, starts, lengths, tables)

    @classmethod
    def spec(cls, rows: int, seq: int, width: int) -> "Chunks":
        """The abstract Chunks of a (rows, seq, width) bucket, to compile its program ahead."""
        row = jax.ShapeDtypeStruct((rows,), jnp.int32)
        return cls(jax.ShapeDtypeStruct((rows, seq), jnp.int32), row, row, jax.ShapeDtypeStruct((rows, width), jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "attention", "unroll", "mesh", "all_logits"),
                   donate_argnames=("cache",))
def prefill(params, cache: kvc.PagedKVCache, chunks: Chunks, *, config: ModelConfig, attention: str | None, unroll,
            mesh=None, all_logits: bool = False):
    """A prefill step of an Ouro model: every chunk in one program (`chunked_prefill.prefill_chunks`;
    attention: its option) -> (logits float32[rows, vocab] after each row's last token
    (all_logits: and [rows, seq, vocab] at every position), cache)."""
    TRACES["prefill_step"] += 1
    logits, written = sharded_prefill_chunks(params, config, cache, chunks.tokens, chunks.starts, chunks.lengths,
                                             chunks.tables, attention=attention, unroll=unroll, mesh=mesh,
                                             all_logits=all_logits)
    return logits, dataclasses.replace(cache, **{name: getattr(written, name) for name in kvc.storage_names(cache)})


@jax.jit
def score_prompt(logits, tokens):
    """`ranked` of each position's next prompt token (logits float32[positions, vocab], tokens
    int32[positions]) with the most alternatives SamplingParams.prompt_logprobs asks for."""
    TRACES["score_prompt"] += 1
    return ranked(logits, tokens, min(MAX_LOGPROBS, logits.shape[-1]))


def state_rows(state, rows: int, whole=None):
    """The first `rows` slots of a WISE state (whole None), or `state` (those rows) written back
    into `whole`."""
    names = ("support", "tag", "tag_position", "depths_run")
    if whole is None:
        return dataclasses.replace(state, **{n: getattr(state, n)[:, :rows] for n in names})
    return dataclasses.replace(state, **{n: getattr(whole, n).at[:, :rows].set(getattr(state, n)) for n in names})


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "tags", "positions", "seq_slots", "table"], meta_fields=[])
@dataclasses.dataclass
class Rows:
    """A decode step's rows, compacted (`wise_core.engine.step_plan.DecodePlan`): tokens int32 (the
    input, -1: its sequence slot's next_token), tags int32 (the WISE token tag, -1: a padding
    row), positions int32 (keys held before the step), seq_slots int32 (the sequence slot of the
    row's per-sequence buffers), table int32[rows, width] (pages, the new token's included; the
    scratch page past them)."""

    tokens: jax.Array
    tags: jax.Array
    positions: jax.Array
    seq_slots: jax.Array
    table: jax.Array

    @classmethod
    def of(cls, plan: DecodePlan) -> "Rows":
        return cls(plan.tokens, plan.tags, plan.positions, plan.seq_slots, plan.page_table)

    @classmethod
    def spec(cls, rows: int, width: int) -> "Rows":
        """The abstract Rows of a (rows, width) step, to compile its program ahead."""
        row = jax.ShapeDtypeStruct((rows,), jnp.int32)
        return cls(row, row, row, row, jax.ShapeDtypeStruct((rows, width), jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "wise_config", "kernel", "unroll", "sampling", "keep_logits",
                                             "mesh", "rows", "width", "num_steps", "adaptive", "scan_loops"),
                   donate_argnames=("cache", "state", "next_token", "logits_state"))
def decode(params: Params, cache: kvc.PagedKVCache, state, next_token, inputs: Rows, draw: Draw,
          processing: Processing | None = None, logits_state: LogitsState | None = None, state_table=None, *,
          config: ModelConfig, wise_config, kernel: str, unroll, sampling: bool, keep_logits: bool, mesh=None,
          rows: int, width: int, num_steps: int | None = None, adaptive: AdaptiveDepth | None = None,
          scan_loops: bool = True):
    """One decode step of `rows` compacted rows (the batch bucket) at context bucket `width`
    (module docstring); the host chose every page (`allocate=False`); processing and
    logits_state None, or both given (`choose`). A Huginn model (num_steps its core iterations,
    None for Ouro) runs `huginn.decode_step` from each row's initial state, state_table[position]
    (on the device), with per-token adaptive depth `adaptive` (None: every iteration). Returns
    (cache, state, next_token, logits_state, (token, logprob, NaN flag, logits or None, ranked or
    None, loops_run)), per row of the bucket; loops_run int32[2] (loops or core iterations the
    live rows ran, live rows) with Ouro's early exit or Huginn's adaptive depth, else None. scan_loops: see
    `wise_jax.model.decode_step`."""
    TRACES["step"] += 1
    step_cache = dataclasses.replace(cache, page_table=inputs.table, seq_lens=inputs.positions,
                                     overflowed=jnp.zeros((), bool))
    rows_state = None if state is None else state_rows(state, rows)
    live = inputs.tags >= 0
    tokens = jnp.where(inputs.tokens >= 0, inputs.tokens, next_token[inputs.seq_slots])
    if num_steps is None:
        exiting = config.early_exit_threshold < 1.0
        logits, step_cache, rows_state, *depths = sharding.decode_step(
            params, config, step_cache, rows_state, tokens, inputs.tags, wise_config=wise_config, kernel=kernel,
            unroll=unroll, mesh=mesh, width=width, return_depths=exiting, allocate=False, scan_loops=scan_loops)
    else:   # the step's table is `width` pages wide: so are its attention and supports
        exiting = adaptive is not None
        logits, step_cache, rows_state, *depths = huginn.decode_step(
            params, config, step_cache, tokens, state_table[inputs.positions], inputs.tags, num_steps=num_steps,
            kernel=kernel, wise_config=wise_config, wise_state=rows_state, adaptive=adaptive, allocate=False,
            scan_loops=scan_loops)
    logits_rows = None if logits_state is None else logits_state.rows(inputs.seq_slots)
    token, logprob, top = choose(logits, draw, processing, logits_rows, sampling=sampling)
    written = jnp.where(live, inputs.seq_slots, next_token.shape[0])     # padding rows write nothing
    next_token = next_token.at[written].set(token, mode="drop")
    if logits_state is not None:
        logits_state = counted(logits_state, inputs.seq_slots, token, processing.active & live)
    cache = dataclasses.replace(cache, **{name: getattr(step_cache, name) for name in kvc.storage_names(cache)})
    if state is not None:
        state = state_rows(rows_state, rows, state)
    loops_run = jnp.stack([jnp.where(live, depths[0], 0).sum(), live.sum()]) if exiting else None
    return cache, state, next_token, logits_state, (token, logprob, jnp.isnan(logprob),
                                                    logits if keep_logits else None, top, loops_run)
