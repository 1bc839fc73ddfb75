"""WISE decode state as a pytree, and the decode attention of one (loop, layer) under WISE.

Per layer and slot (a batch row) the state holds the support found for the token being decoded,
the (tag, position) it was found for, and a bitmask of the discovery depths that ran for it. The
tag is the WISE token tag the caller passes per row (`tags`; `wise_core.engine.step_plan`: the
engines issue one per decoded token). A reuse depth attends sparsely only when the stored
(tag, position) matches the row's current (tag, position) and every discovery depth ran;
otherwise it attends densely and counts a fallback. The position keeps a tag that a functional
caller reuses across steps (e.g. a request's id every step) safe: a support found for that
request's previous token does not match its next one. The arrays are layer-major, so one layer's
rows are one contiguous slice, read and written in place by the decode step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from wise_core import modes as M
from wise_core.selection import SelectionContext
from wise_core.wise_config import WiseConfig
from wise_jax import checks
from wise_jax.attention import causal_blocks, decode_attention


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["support", "tag", "tag_position", "depths_run", "fallbacks",
                                "selected_blocks", "causal_blocks"],
                   meta_fields=["block_size", "discover_depths", "reuse_depths"])
@dataclasses.dataclass
class WiseState:
    """support bool[layers, slots, heads, max_blocks]; tag, tag_position int32[layers, slots]
    (-1: none): the WISE token tag and the position of the token each support was found for (the
    position keeps a tag that a functional caller reuses across steps, e.g. a request's id every
    step, safe); depths_run int32[layers, slots] (bit d set when discovery depth d ran);
    fallbacks int32[] ((token, layer) pairs that fell back to dense at a reuse depth);
    selected_blocks, causal_blocks float32[n_reuse], in reuse_depths order: sums over reuse-depth
    calls, per (row, head), of the causal blocks attended (all of them on a fallback) and of the
    causal blocks. block_size, discover_depths, reuse_depths (static): those of the WiseConfig
    the state was made for, which a decode step checks its WiseConfig against (`wise_jax.checks`)."""

    support: jax.Array
    tag: jax.Array
    tag_position: jax.Array
    depths_run: jax.Array
    fallbacks: jax.Array
    selected_blocks: jax.Array
    causal_blocks: jax.Array
    block_size: int
    discover_depths: tuple[int, ...]
    reuse_depths: tuple[int, ...]

    def density(self, wise_config: WiseConfig) -> dict[int, float | None]:
        """Per reuse depth: selected / causal blocks over its calls (None before any); on the host."""
        selected, causal = np.asarray(self.selected_blocks), np.asarray(self.causal_blocks)
        return {d: float(selected[i] / causal[i]) if causal[i] else None
                for i, d in enumerate(wise_config.reuse_depths)}


def create(wise_config: WiseConfig, *, slots: int, layers: int, heads: int, max_blocks: int) -> WiseState:
    """A state with no support recorded (tags -1) and zero counters, for `wise_config`."""
    checks.state_settings(wise_config, slots=slots, layers=layers, heads=heads, max_blocks=max_blocks)
    n_reuse = len(wise_config.reuse_depths)
    return WiseState(
        support=jnp.zeros((layers, slots, heads, max_blocks), bool),
        tag=jnp.full((layers, slots), -1, jnp.int32),
        tag_position=jnp.full((layers, slots), -1, jnp.int32),
        depths_run=jnp.zeros((layers, slots), jnp.int32),
        fallbacks=jnp.zeros((), jnp.int32),
        selected_blocks=jnp.zeros((n_reuse,), jnp.float32),
        causal_blocks=jnp.zeros((n_reuse,), jnp.float32),
        block_size=wise_config.block_size, discover_depths=wise_config.discover_depths,
        reuse_depths=wise_config.reuse_depths)


def reset_counters(state: WiseState) -> WiseState:
    """Zero the fallback and density counters."""
    return dataclasses.replace(state, fallbacks=jnp.zeros_like(state.fallbacks),
                               selected_blocks=jnp.zeros_like(state.selected_blocks),
                               causal_blocks=jnp.zeros_like(state.causal_blocks))


def discovery_mask(wise_config: WiseConfig) -> int:
    """Bitmask with bit d set for every discovery depth d."""
    return sum(1 << d for d in wise_config.discover_depths)


def _complete(state: WiseState, wise_config: WiseConfig, tags, position, layer=None):
    """Rows whose support is this very token's (tags, position int32[batch]), found by every
    discovery depth: bool[batch] for `layer`, or bool[layers, batch] for every layer (layer None)."""
    tag, tag_position, depths_run = ((state.tag, state.tag_position, state.depths_run) if layer is None else
                                     (state.tag[layer], state.tag_position[layer], state.depths_run[layer]))
    full = discovery_mask(wise_config)
    return (tag == tags) & (tag_position == position) & ((depths_run & full) == full)


def _reuse_index(wise_config: WiseConfig, loop: int | jax.Array) -> int | jax.Array:
    """The position of reuse depth `loop` in reuse_depths (the density counters' order); a traced
    loop (int32[], a reuse depth) gives a traced index."""
    if isinstance(loop, int):
        return wise_config.reuse_depths.index(loop)
    table = np.full(max(wise_config.reuse_depths) + 1, -1, np.int32)
    table[list(wise_config.reuse_depths)] = np.arange(len(wise_config.reuse_depths))
    return jnp.asarray(table)[loop]


def count_reuse(state: WiseState, wise_config: WiseConfig, loop: int | jax.Array, seq_lens, tags, active,
                n_blocks: int) -> WiseState:
    """Add reuse depth `loop`'s fallbacks and density counts of every layer at once (what
    `wise_attention(..., count=True)` adds one layer at a time): the decode step calls it once per
    reuse loop, before the loop's layers, as nothing they run changes the supports or tags.
    loop: a Python int or a traced int32[] (a reuse depth); seq_lens, tags, active [batch] as
    wise_attention's; n_blocks: the blocks attended."""
    complete = _complete(state, wise_config, tags, seq_lens - 1)                   # [layers, batch]
    return _add_counts(state, wise_config, loop, state.support[:, :, :, :n_blocks], complete,
                       causal_blocks(seq_lens, wise_config.block_size, n_blocks), active)


def _add_counts(state: WiseState, wise_config: WiseConfig, loop: int | jax.Array, support, complete, causal,
                active) -> WiseState:
    """support bool[..., batch, heads, n_blocks], complete bool[..., batch] (one layer or every
    layer), causal bool[batch, n_blocks], active bool[batch] -> the state with the counts added."""
    depth = _reuse_index(wise_config, loop)
    heads = support.shape[-2]
    n_causal = causal.sum(-1, dtype=jnp.int32)                                    # [batch]
    n_supported = (support & causal[:, None, :]).sum((-1, -2), dtype=jnp.int32)   # [..., batch]
    attended = jnp.where(complete, n_supported, heads * n_causal)
    counted = active.astype(jnp.int32)
    layers = complete.size // complete.shape[-1]
    return dataclasses.replace(
        state,
        fallbacks=state.fallbacks + (counted * ~complete).sum(dtype=jnp.int32),
        selected_blocks=state.selected_blocks.at[depth].add((counted * attended).sum().astype(jnp.float32)),
        causal_blocks=state.causal_blocks.at[depth].add(
            (layers * heads * (counted * n_causal).sum()).astype(jnp.float32)))


def wise_attention(state: WiseState, wise_config: WiseConfig, loop: int | jax.Array, layer: jax.Array, q, k_pages,
                   v_pages, page_table, seq_lens, tags, active, *, kernel: str, validate: bool = True,
                   count: bool = True, role: str | None = None, k_scale=None,
                   v_scale=None) -> tuple[jax.Array, WiseState]:
    """Decode attention of `layer` at `loop` with the row modes WISE assigns, updating the state.

    loop: a Python int, or a traced int32[] (a decode step scanning a run of loops of one role,
    `WiseConfig.role_runs`) with `role` its role ('discover', 'reuse' or 'dense'; derived from
    a Python int loop when None).

    q: [batch, heads, head_dim]; pages / page_table / seq_lens as decode_attention (the token at
    position seq_lens - 1 is being decoded; the supports read and written are the first
    page_table.shape[1] * page_size // block_size blocks, the step's context bucket: a support
    never outlives its token, so the blocks past them are never read); tags int32[batch]: each
    row's WISE token tag (`wise_core.engine.step_plan`; a support is reused only under the same
    tag and position); active bool[batch]: the rows that decode a token. Other rows (empty
    slots) are masked: their support, tags and counters are left as they were. validate: check
    the attention's input values (`decode_check.check_call`; the decode step, which builds them
    by construction, passes False); count: at a reuse depth, add this layer's fallbacks and
    density counts (the decode step passes False and counts every layer at once,
    `count_reuse`). A Custom(..., context=True) selection rule reads this call's
    `SelectionContext` (seq_lens, the loop and layer as int32 arrays, head and block indices).
    k_scale, v_scale: an fp8 cache's scales, the pages its codes (`decode_attention`: the
    reference reads them dequantized, so the selection runs on the dequantized scores).
    Returns (out [batch, heads, head_dim], state).
    """
    if role is None:
        if not isinstance(loop, int):
            raise ValueError("wise_attention at a traced loop needs its role ('discover', 'reuse' or 'dense')")
        role = wise_config.depth_role(loop)
    batch = q.shape[0]
    position = seq_lens - 1
    n_blocks = page_table.shape[1] * k_pages.shape[1] // wise_config.block_size
    support = state.support[layer, :, :, :n_blocks]
    tagged = (state.tag[layer] == tags) & (state.tag_position[layer] == position)
    depths_run = state.depths_run[layer]
    bit = jnp.left_shift(jnp.int32(1), loop)

    if role == "discover":
        # the first discovery depth starts the token's support; a later one unions only onto
        # support found for this very token
        fresh = (loop == min(wise_config.discover_depths)) | ~tagged
        modes = jnp.where(fresh, M.DISCOVER, M.DISCOVER_UNION).astype(jnp.int32)
    elif role == "reuse":
        complete = _complete(state, wise_config, tags, position, layer)
        modes = jnp.where(complete, M.SPARSE, M.DENSE).astype(jnp.int32)
    else:
        modes = jnp.full((batch,), M.DENSE, jnp.int32)

    context = SelectionContext(seq_lens=seq_lens, loop=jnp.asarray(loop, jnp.int32), layer=jnp.asarray(layer, jnp.int32),
                               head=jnp.arange(q.shape[1], dtype=jnp.int32),
                               block=jnp.arange(n_blocks, dtype=jnp.int32), block_size=wise_config.block_size)
    scales = {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
    out, new_support = decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes, support,
                                        block_size=wise_config.block_size, eta=wise_config.eta, kernel=kernel,
                                        validate=validate, reuse=role == "reuse", selection=wise_config.selection,
                                        selection_context=context, **scales)
    causal = causal_blocks(seq_lens, wise_config.block_size, n_blocks)       # [batch, n_blocks]

    if role == "discover":
        if wise_config.all_blocks:
            new_support = jnp.broadcast_to(causal[:, None, :], new_support.shape)

        def keep(new, old):  # masked rows keep what they held
            return jnp.where(active.reshape((batch,) + (1,) * (new.ndim - 1)), new, old)

        state = dataclasses.replace(
            state,
            support=state.support.at[layer, :, :, :n_blocks].set(keep(new_support, support)),
            tag=state.tag.at[layer].set(keep(tags, state.tag[layer])),
            tag_position=state.tag_position.at[layer].set(keep(position, state.tag_position[layer])),
            depths_run=state.depths_run.at[layer].set(
                keep(jnp.where(fresh, bit, depths_run | bit), depths_run)))
    elif role == "reuse" and count:
        state = _add_counts(state, wise_config, loop, support, complete, causal, active)
    return out, state
