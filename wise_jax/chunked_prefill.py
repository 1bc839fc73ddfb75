"""Prefill of a step's prompt chunks over the paged cache, all in one program.

    logits, cache = prefill_chunks(params, config, cache, tokens, starts, lengths, tables)

Row r of the step holds one chunk: tokens at positions [starts[r], starts[r] + lengths[r]) of
one request (a first chunk starts at 0; a later one continues a prompt whose earlier chunks are
in the cache). Every layer of every loop writes the chunks' K/V into their requests' pages
(`tables`: each request's pages, in order) and attends over every key of its request up to each
query's position: the earlier chunks' from the cache and its own. Attention is a float32 softmax
over the gathered keys, one page of queries at a time ([kv_heads, group, page_size, keys] scores),
so its memory is linear in the chunk; a value past the row's keys is read as 0 (a page's stale
or scratch contents never reach the output, NaN included). Positions of the padding past a row's
length (and padding rows, length 0) write the scratch page (the storage's last) and their outputs
are dropped. The loops run as a scan (the plane index traced) of a scan over the stacked layers.

An fp8 cache (`kv_cache`'s kv_cache_dtype "fp8") stores the chunks' K/V quantized, and every
query reads every key as the cache gives it back, dequantized to the model's dtype: the earlier
chunks' from the pages and its own chunk's too (through the pages, or `kv_cache.stored_values`
of the keys just computed when the chunks open their prompts), so a prompt's tokens do not
depend on how it was chunked, or on a prefix read from cached pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from wise_core.model_config import ModelConfig
from wise_jax import kv_cache as kvc
from wise_jax import sharding
from wise_jax.model import embed, exit_gate, exits_for, head, rope, run_loop
from wise_jax.params import Params, stack_layers
from wise_jax.prefill_attention import causal_attention


def prefix_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, held: jax.Array,
                     block: int) -> jax.Array:
    """q [seq, heads, head_dim] at `positions` int32[seq]; k, v [keys, kv_heads, head_dim], key j
    at position j, the first `held` (int32[]) of them the request's -> [seq, heads, head_dim]:
    query i reads the keys at positions <= positions[i]; a value past `held` is read as 0 (what a
    page holds past the request's keys never reaches a query, NaN included). Queries run `block`
    at a time (seq a multiple of it); scale head_dim**-0.5."""
    seq, heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(seq // block, block, kv_heads, heads // kv_heads, dim)
    key_pos = jnp.arange(k.shape[0], dtype=jnp.int32)
    v = jnp.where((key_pos < held)[:, None, None], v, 0)

    def one(args):
        qb, pos = args
        scores = jnp.einsum("qkgd,skd->kgqs", qb, k, preferred_element_type=jnp.float32) * dim ** -0.5
        probs = jax.nn.softmax(jnp.where(key_pos[None, :] <= pos[:, None], scores, -jnp.inf), axis=-1)
        return jnp.einsum("kgqs,skd->qkgd", probs.astype(v.dtype), v)

    out = lax.map(one, (qg, positions.reshape(-1, block)))
    return out.reshape(seq, heads, dim).astype(q.dtype)


def prefill_chunks(params: Params, config: ModelConfig, cache: kvc.PagedKVCache, tokens: jax.Array,
                   starts: jax.Array, lengths: jax.Array, tables: jax.Array, *, attention: str | None = None,
                   unroll: int | bool = 1, axis_name: str | None = None, all_logits: bool = False) -> tuple:
    """The chunks (module docstring). cache: the paged cache whose storage [planes, num_pages + 1,
    page_size, kv_heads, head_dim] (and an fp8 cache's scales) the chunks write (its page table
    and lengths are not read); tokens int32[rows, seq] (seq a multiple of page_size, row r
    valid up to lengths[r]); starts, lengths int32[rows] (a padding row: length 0); tables
    int32[rows, width] (each row's pages, holding at least start + length positions; entries
    past them: the scratch page). Returns (logits float32[rows, vocab] after each chunk's last
    token, of its exit loop (every loop runs), cache); all_logits: logits is (those,
    the logits float32[rows, seq, vocab] at every position, each of its token's exit loop), as
    `model.prefill`. attention None: each row attends its keys gathered from the pages (any
    start); an implementation of `prefill_attention.causal_attention` (every start 0, the chunks
    opening their prompts): each row attends its own keys through it (cuDNN's flash attention on a
    GPU), the pages only written."""
    params = stack_layers(params)
    rows, seq = tokens.shape
    page_size, scratch = cache.page_size, cache.scratch_page
    positions = starts[:, None] + jnp.arange(seq, dtype=jnp.int32)[None]            # [rows, seq]
    valid = jnp.arange(seq)[None] < lengths[:, None]
    column = jnp.minimum(positions // page_size, tables.shape[1] - 1)
    page = jnp.where(valid, jnp.take_along_axis(tables, column, axis=1), scratch)
    offset = positions % page_size
    h = embed(params, tokens)
    cos, sin = rope(positions, config.head_dim, config.rope_theta)
    over_pages = jax.vmap(prefix_attention, in_axes=(0, 0, 0, 0, 0, None))

    def one_loop(carry, loop):
        h, cache, exits = carry

        def attend(q, k, v, layer, cache):
            plane = loop * config.num_hidden_layers + layer
            cache = kvc.store(cache, (plane, page, offset), k, v)
            if attention is not None:
                k_seen, v_seen = kvc.stored_values(cache, k), kvc.stored_values(cache, v)
                return causal_attention(q, k_seen, v_seen, implementation=attention), cache
            k_seen, v_seen = kvc.plane_keys(cache, plane, tables, k.dtype)
            return over_pages(q, k_seen, v_seen, positions, starts + lengths, page_size), cache
        h, cache = run_loop(params, config, h, cos, sin, attend, cache, unroll=unroll, axis_name=axis_name)
        if exits is not None:                                    # every token's exit, as torch's
            exits = exits.end_loop(loop, h, exit_gate(params, h))
        return (h, cache, exits), None

    (h, cache, exits), _ = lax.scan(one_loop, (h, cache, exits_for(config, h)),
                                    jnp.arange(config.total_ut_steps, dtype=jnp.int32))
    out = h if exits is None else exits.output(h)               # each token's exit loop
    last = jnp.take_along_axis(out, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = (head(params, last), head(params, out)) if all_logits else head(params, last)
    return logits, cache


def sharded_prefill_chunks(params, config: ModelConfig, cache: kvc.PagedKVCache, tokens, starts, lengths, tables, *,
                           attention: str | None = None, unroll: int | bool = 1, mesh=None, all_logits: bool = False):
    """`prefill_chunks`; over a mesh (MeshParams, storage sharded on kv_heads) shard_map'd at the
    local config, as `sharding.prefill`."""
    if mesh is None:
        return prefill_chunks(params, config, cache, tokens, starts, lengths, tables, attention=attention,
                              unroll=unroll, all_logits=all_logits)
    local = sharding.local_config(config, sharding.tp_size(mesh))

    def run(params, cache, tokens, starts, lengths, tables):
        return prefill_chunks(params, local, cache, tokens, starts, lengths, tables, attention=attention,
                              unroll=unroll, axis_name=sharding.AXIS, all_logits=all_logits)

    specs = sharding.cache_specs(cache)
    return jax.shard_map(run, mesh=mesh, in_specs=(sharding.param_specs(params.params), specs, P(), P(), P(), P()),
                         out_specs=(P(), specs), check_vma=False)(
        params.params, cache, tokens, starts, lengths, tables)
