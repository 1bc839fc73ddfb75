"""Prefill of a prompt chunk that continues one already in the paged cache (chunked prefill).

    logits, k, v = prefill_chunk(params, config, k, v, tokens, start, length, table)

The chunk's tokens sit at positions [start, start + length) of one request (start > 0; a chunk
at position 0 is `model.prefill`'s, which needs no cache). Every layer of every loop writes the
chunk's K/V into the request's pages (`table`: its pages covering the chunk, in order) and
attends over every key of the request up to each query's position: the earlier chunks' from the
cache and its own. Attention is a float32 softmax over the gathered keys, one page of queries
at a time ([kv_heads, group, page_size, keys] scores), so its memory is linear in the chunk.
Positions of the padding past `length` write the scratch page (the storage's last) and their
rows are dropped. The layers run as a scan over stacked weights (as `model.prefill`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from wise_core.config import ModelConfig
from wise_jax import sharding
from wise_jax.model import embed, exit_gate, exits_for, head, rope, run_loop
from wise_jax.params import Params, stack_layers


def prefix_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, block: int,
                     held: jax.Array) -> jax.Array:
    """q [seq, heads, head_dim] at `positions` int32[seq]; k, v [keys, kv_heads, head_dim], key j
    at position j, the first `held` (int32[]) the request's -> [seq, heads, head_dim]: query i
    reads the keys at positions <= positions[i]. A value past `held` reads as 0: the pages' slots
    the request has not written hold whatever their last holder left (NaN too), and 0 x NaN in
    probs @ v would reach a query that never attends them. Queries run `block` at a time (seq a
    multiple of it); scale head_dim**-0.5."""
    seq, heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(seq // block, block, kv_heads, heads // kv_heads, dim)
    key_pos = jnp.arange(k.shape[0], dtype=jnp.int32)
    v = jnp.where((key_pos < held)[:, None, None], v, jnp.zeros((), v.dtype))

    def one(args):
        qb, pos = args
        scores = jnp.einsum("qkgd,skd->kgqs", qb, k, preferred_element_type=jnp.float32) * dim ** -0.5
        probs = jax.nn.softmax(jnp.where(key_pos[None, :] <= pos[:, None], scores, -jnp.inf), axis=-1)
        return jnp.einsum("kgqs,skd->qkgd", probs.astype(v.dtype), v)

    out = lax.map(one, (qg, positions.reshape(-1, block)))
    return out.reshape(seq, heads, dim).astype(q.dtype)


def prefill_chunk(params: Params, config: ModelConfig, k_pages: jax.Array, v_pages: jax.Array, tokens: jax.Array,
                  start: jax.Array, length: jax.Array, table: jax.Array, *, unroll: int | bool = 1,
                  axis_name: str | None = None, all_logits: bool = False) -> tuple:
    """The chunk (module docstring). k_pages, v_pages: the cache storage [planes, num_pages + 1,
    page_size, kv_heads, head_dim]; tokens int32[seq] (seq a multiple of page_size, valid up to
    `length`); start, length int32[]; table int32[pages] (the request's pages, holding at least
    start + seq positions; entries past its pages: the scratch page). Returns (logits
    float32[vocab] after the chunk's last token, of its exit loop (every loop runs), k_pages,
    v_pages); all_logits: logits is (those, the logits float32[seq, vocab] at every position of
    the chunk, each of its token's exit loop), as `model.prefill`."""
    params = stack_layers(params)
    seq = tokens.shape[0]
    page_size, scratch = k_pages.shape[2], k_pages.shape[1] - 1
    positions = start + jnp.arange(seq, dtype=jnp.int32)
    valid = jnp.arange(seq) < length
    page = jnp.where(valid, table[jnp.minimum(positions // page_size, table.shape[0] - 1)], scratch)
    offset = positions % page_size
    h = embed(params, tokens[None])
    cos, sin = rope(positions[None], config.head_dim, config.rope_theta)
    keys = table.shape[0] * page_size
    pages = (k_pages, v_pages)
    exits = exits_for(config, h[0])
    for loop in range(config.total_ut_steps):
        def attend(q, k, v, layer, pages, loop=loop):
            plane = loop * config.num_hidden_layers + layer
            pages = tuple(store.at[plane, page, offset].set(x[0].astype(store.dtype)) for store, x in zip(pages, (k, v)))
            context = [store[plane, table].reshape((keys,) + store.shape[3:]) for store in pages]
            return prefix_attention(q[0], *context, positions, page_size, start + length)[None], pages
        h, pages = run_loop(params, config, h, cos, sin, attend, pages, unroll=unroll, axis_name=axis_name)
        if exits is not None:                                    # every token's exit, as torch's
            exits = exits.end_loop(loop, h[0], exit_gate(params, h[0]))
    out = h[0] if exits is None else exits.output(h[0])          # each token's exit loop
    last = lax.dynamic_index_in_dim(out, length - 1, 0, keepdims=False)
    logits = (head(params, last), head(params, out)) if all_logits else head(params, last)
    return logits, pages[0], pages[1]


def sharded_prefill_chunk(params, config: ModelConfig, k_pages, v_pages, tokens, start, length, table, *,
                          unroll: int | bool = 1, mesh=None, all_logits: bool = False):
    """`prefill_chunk`; over a mesh (MeshParams, storage sharded on kv_heads) shard_map'd at the
    local config, as `sharding.prefill`."""
    if mesh is None:
        return prefill_chunk(params, config, k_pages, v_pages, tokens, start, length, table, unroll=unroll,
                             all_logits=all_logits)
    local = sharding.local_config(config, sharding.tp_size(mesh))

    def run(params, k_pages, v_pages, tokens, start, length, table):
        return prefill_chunk(params, local, k_pages, v_pages, tokens, start, length, table, unroll=unroll,
                             axis_name=sharding.AXIS, all_logits=all_logits)

    kv = sharding.KV_SPEC
    return jax.shard_map(run, mesh=mesh, in_specs=(sharding.param_specs(params.params), kv, kv, P(), P(), P(), P()),
                         out_specs=(P(), kv, kv), check_vma=False)(
        params.params, k_pages, v_pages, tokens, start, length, table)
