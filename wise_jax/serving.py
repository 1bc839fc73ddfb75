"""Serving in the pure-function style: prefill one request, insert its K/V into a cache row,
decode every row one token.

    logits, kv = prefill(params, config, prompt_ids)          # one request, its own bucket
    cache = insert(cache, kv, slot)                             # into an empty row
    logits, cache, state = decode_step(params, config, cache, state, tokens, tags,
                                       wise_config=wise_config, kernel="auto")

`decode_step` is jit-compiled and donates the cache and the WISE state (updated in place). The
host loop that admits and retires requests around these is `wise_jax.engine.LLM`, on which
`generate` and `teacher_force` run.

Buckets. A prompt of n tokens is prefilled padded to `pages_for(n) * page_size` positions: one
compilation per page count, at most page_size - 1 padding positions per prompt (< one page). A
decode step compiles once per cache shape (rows, max_pages, num_pages), context bucket (`width`,
the page-table columns it attends over) and settings. `TRACES` counts the traces (=
compilations) of each program.

Several devices: `mesh` (a jax.sharding.Mesh with axis "tp", `wise_jax.sharding`) runs prefill
and the decode step with the heads sharded over it; params, cache and state must then be in the
mesh layout (`sharding.shard_params`, `sharding.create_cache`, `sharding.create_state`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from wise_core.model_config import ModelConfig
from wise_core.tokenizer import check_token_ids
from wise_core.wise_config import WiseConfig
from wise_jax import checks
from wise_jax import kv_cache as kvc
from wise_jax import sharding
from wise_jax import wise_state as ws
from wise_jax.params import Params

DEFAULT_PAGE_SIZE = 128
TRACES: collections.Counter = collections.Counter()


def trace_counts() -> dict[str, int]:
    """Traces (= compilations) so far of each jit-compiled serving program."""
    return dict(TRACES)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "length"], meta_fields=[])
@dataclasses.dataclass
class RequestKV:
    """One prefilled request: k, v [planes, n_pages * page_size, kv_heads, head_dim], valid up to
    length (int32[])."""

    k: jax.Array
    v: jax.Array
    length: jax.Array


def prefill_bucket(length: int, page_size: int) -> int:
    """Positions a prompt of `length` tokens is prefilled at: whole pages."""
    return -(-length // page_size) * page_size


@functools.partial(jax.jit, static_argnames=("config", "attention", "unroll", "mesh", "all_logits"))
def _prefill(params: Params, tokens, length, *, config: ModelConfig, attention: str, unroll, mesh=None,
             all_logits: bool = False):
    TRACES["prefill"] += 1
    logits, k, v = sharding.prefill(params, config, tokens, length, attention=attention, unroll=unroll, mesh=mesh,
                                    all_logits=all_logits)
    return logits, RequestKV(k, v, length)


def prefill(params: Params, config: ModelConfig, tokens: Sequence[int], *, page_size: int = DEFAULT_PAGE_SIZE,
            attention: str = "auto", unroll: int | bool = 1, mesh=None, all_logits: bool = False
            ) -> tuple[jax.Array, RequestKV]:
    """Prefill one prompt (token ids) -> (logits float32[vocab] after its last token, its K/V).

    The prompt is padded to whole pages of `page_size` (pad id: config.pad_token_id or 0);
    attention: see `wise_jax.prefill_attention`; unroll: layers per scan step; mesh: see the
    module docstring (the K/V come back sharded on kv_heads); all_logits: the logits are
    (those, the logits float32[padded length, vocab] at every position), `model.prefill`'s.
    params are checked against config (`checks.prefill`)."""
    checks.prefill(params, config, tokens)
    ids = check_token_ids(tokens, config.vocab_size, "tokens")
    if len(ids) > config.max_position_embeddings:
        raise ValueError(f"a prompt of {len(ids)} tokens exceeds max_position_embeddings "
                         f"({config.max_position_embeddings})")
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    padded = np.full((prefill_bucket(len(ids), page_size),), config.pad_token_id or 0, np.int32)
    padded[:len(ids)] = ids
    return _prefill(params, jnp.asarray(padded), jnp.asarray(len(ids), jnp.int32), config=config,
                    attention=attention, unroll=unroll, mesh=mesh, all_logits=all_logits)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _insert(cache: kvc.PagedKVCache, kv: RequestKV, slot) -> kvc.PagedKVCache:
    TRACES["insert"] += 1
    return kvc.insert(cache, kv.k, kv.v, kv.length, slot)


def insert(cache: kvc.PagedKVCache, kv: RequestKV, slot: int) -> kvc.PagedKVCache:
    """Store a prefilled request in the empty cache row `slot` (donates `cache`). Raises
    ValueError for a slot out of range or in use or K/V that do not fit the cache
    (`checks.request_kv`), PoolExhaustedError when its pages do not fit."""
    checks.request_kv(cache, getattr(kv, "k", None), getattr(kv, "v", None))
    rows = cache.seq_lens.shape[0]
    if not isinstance(slot, numbers.Integral) or not 0 <= slot < rows:
        raise ValueError(f"slot must be an integer in [0, {rows}), got {slot!r}")
    if int(cache.seq_lens[slot]):
        raise ValueError(f"slot {slot} holds a request ({int(cache.seq_lens[slot])} keys); release it first")
    need = int(kvc.pages_for(kv.length, cache.page_size))
    if need > int(cache.num_free):
        raise kvc.PoolExhaustedError(f"the request needs {need} pages but only {int(cache.num_free)} "
                                     f"of {cache.num_pages} are free")
    return _insert(cache, kv, jnp.asarray(slot, jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "wise_config", "kernel", "unroll", "mesh", "width"),
                   donate_argnames=("cache", "state"))
def decode_step(params: Params, config: ModelConfig, cache: kvc.PagedKVCache, state: ws.WiseState | None,
                tokens: jax.Array, tags: jax.Array, *, wise_config: WiseConfig | None = None,
                kernel: str = "auto", unroll: int | bool = 1, mesh=None, width: int | None = None):
    """`wise_jax.model.decode_step`, jit-compiled, donating cache and state: tokens int32[rows]
    (each row's next input), tags int32[rows] (each row's WISE token tag, -1 empty) ->
    (logits float32[rows, vocab], cache, state). Check `cache.overflowed` after it. Pass
    unstacked params (`params.unstack_layers`, as `LLM` does) for the fast step: stacked ones
    run a scan that copies each layer's weights every step. mesh: see the module docstring.
    width: the context bucket (`model.decode_step`; None: the whole page table). The arguments
    are checked when traced, before the step is (`checks.decode_step`)."""
    checks.decode_step(params, config, cache, state, tokens, tags, wise_config, width)
    TRACES["decode_step"] += 1
    return sharding.decode_step(params, config, cache, state, tokens, tags, wise_config=wise_config,
                                kernel=kernel, unroll=unroll, mesh=mesh, width=width)
