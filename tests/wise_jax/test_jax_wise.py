"""wise_jax.wise_state: modes per depth, union of discovery depths, fallback to dense when the
support is incomplete or foreign (counted), density counters. GQA shapes, fp32."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wise_core import modes as M
from wise_core.wise_config import WiseConfig
from wise_jax import wise_state as ws
from wise_jax.attention import decode_attention_reference

WISE = WiseConfig(eta=0.8)
HEADS, KV_HEADS, DIM, PAGE = 4, 2, 16, 32
LAYER = 1


@functools.partial(jax.jit, static_argnames=("loop",))
def _wise(state, q, k, v, table, seq_lens, tags, active, *, loop):
    return ws.wise_attention(state, WISE, loop, jnp.int32(LAYER), q, k, v, table, seq_lens, tags, active,
                             kernel="reference")


@jax.jit
def _plain(q, k, v, table, seq_lens, modes, support):
    return decode_attention_reference(q, k, v, table, seq_lens, modes, support, block_size=WISE.block_size,
                                      eta=WISE.eta)


@pytest.fixture(scope="module")
def cache():
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((8, PAGE, KV_HEADS, DIM)) * 2, jnp.float32)
    v = jnp.asarray(rng.standard_normal((8, PAGE, KV_HEADS, DIM)), jnp.float32)
    table = jnp.asarray([[3, 0, 5, 7], [1, 6, 2, 4]], jnp.int32)
    return k, v, table


def _q(seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((2, HEADS, DIM)) * 3, jnp.float32)


def _modes(*modes):
    return jnp.asarray(modes, jnp.int32)


def _discover_union_reuse(cache):
    """Loops 0 and 1 discover, loop 2 reuses, at layer LAYER; checks each step. Returns the state."""
    k, v, table = cache
    lens, tags, active = jnp.asarray([100, 57], jnp.int32), jnp.asarray([7, 8], jnp.int32), jnp.ones(2, bool)
    state = ws.create(WISE, slots=2, layers=2, heads=HEADS, max_blocks=4)
    empty = jnp.zeros((2, HEADS, 4), bool)

    out0, state = _wise(state, _q(0), k, v, table, lens, tags, active, loop=0)
    dense0, sel0 = _plain(_q(0), k, v, table, lens, _modes(M.DISCOVER, M.DISCOVER), empty)
    assert np.array_equal(out0, dense0) and np.array_equal(state.support[LAYER], sel0)
    _, state = _wise(state, _q(1), k, v, table, lens, tags, active, loop=1)
    _, sel1 = _plain(_q(1), k, v, table, lens, _modes(M.DISCOVER, M.DISCOVER), empty)
    union = np.asarray(sel0) | np.asarray(sel1)
    assert np.array_equal(state.support[LAYER], union)
    assert np.asarray(state.depths_run[LAYER]).tolist() == [0b11, 0b11]
    assert not np.asarray(state.support[1 - LAYER]).any()               # other layers untouched

    out2, state = _wise(state, _q(2), k, v, table, lens, tags, active, loop=2)
    sparse2, _ = _plain(_q(2), k, v, table, lens, _modes(M.SPARSE, M.SPARSE), jnp.asarray(union))
    assert np.array_equal(out2, sparse2)
    assert int(state.fallbacks) == 0
    causal = np.arange(4)[None, :] * 32 < np.asarray(lens)[:, None]
    expected = (union & causal[:, None, :]).sum() / (HEADS * causal.sum())
    assert state.density(WISE)[2] == pytest.approx(expected, rel=1e-6)
    assert state.density(WISE)[3] is None                                   # depth 3 has not run
    return state


def test_discover_union_then_sparse_reuse(cache):
    _discover_union_reuse(cache)


def test_fallback_when_discovery_incomplete_or_foreign(cache):
    k, v, table = cache
    lens, tags, active = jnp.asarray([100, 57], jnp.int32), jnp.asarray([7, 8], jnp.int32), jnp.ones(2, bool)
    state = _discover_union_reuse(cache)
    support = state.support[LAYER]

    # Slot 0 now serves request 9 (tag 9) at the same position: its support is foreign. Slot 1 keeps its own.
    out, state = _wise(state, _q(3), k, v, table, lens, jnp.asarray([9, 8], jnp.int32), active, loop=3)
    expected, _ = _plain(_q(3), k, v, table, lens, _modes(M.DENSE, M.SPARSE), support)
    assert np.array_equal(out, expected) and int(state.fallbacks) == 1

    # The next position runs only discovery depth 1: it starts a fresh support, not a union onto
    # the previous token's, and the reuse depth falls back (counted only for active rows).
    lens = lens + 1
    _, state = _wise(state, _q(4), k, v, table, lens, tags, active, loop=1)
    _, sel = _plain(_q(4), k, v, table, lens, _modes(M.DISCOVER, M.DISCOVER), jnp.zeros_like(support))
    assert np.array_equal(state.support[LAYER], sel)
    assert np.asarray(state.depths_run[LAYER]).tolist() == [0b10, 0b10]
    out, state = _wise(state, _q(5), k, v, table, lens, tags, jnp.asarray([True, False]), loop=2)
    dense, _ = _plain(_q(5), k, v, table, lens, _modes(M.DENSE, M.DENSE), sel)
    assert np.array_equal(out, dense) and int(state.fallbacks) == 2
    state = ws.reset_counters(state)
    assert int(state.fallbacks) == 0 and state.density(WISE) == {2: None, 3: None}


def test_all_blocks_selects_every_causal_block(cache):
    k, v, table = cache
    lens = jnp.asarray([100, 57], jnp.int32)
    config = WiseConfig(all_blocks=True)
    state = ws.create(config, slots=2, layers=2, heads=HEADS, max_blocks=4)
    discover = jax.jit(functools.partial(ws.wise_attention, wise_config=config, loop=0, kernel="reference"))
    _, state = discover(state, layer=jnp.int32(0), q=_q(0), k_pages=k, v_pages=v, page_table=table, seq_lens=lens,
                        tags=jnp.asarray([0, 1]), active=jnp.ones(2, bool))
    assert np.asarray(state.support[0]).sum(-1).tolist() == [[4] * HEADS, [2] * HEADS]


def test_reuse_loops_call_reuse(cache, monkeypatch):
    """The reuse depths tell decode_attention theirs are reuse calls (rows SPARSE or DENSE; the
    Mosaic kernel's launch and in-kernel merge); discovery depths do not."""
    k, v, table = cache
    hints = []
    real = ws.decode_attention

    def spy(*args, reuse=False, **kwargs):
        hints.append(reuse)
        return real(*args, reuse=reuse, **kwargs)

    monkeypatch.setattr(ws, "decode_attention", spy)
    state = ws.create(WISE, slots=2, layers=2, heads=HEADS, max_blocks=4)
    lens, tags, active = jnp.asarray([100, 57], jnp.int32), jnp.asarray([7, 8], jnp.int32), jnp.ones(2, bool)
    for loop in range(4):  # eagerly: the spy runs per call
        _, state = ws.wise_attention(state, WISE, loop, jnp.int32(LAYER), _q(loop), k, v, table, lens, tags,
                                     active, kernel="reference")
    assert hints == [False, False, True, True]


def test_count_reuse_adds_every_layer_as_wise_attention_does_layer_by_layer(cache):
    """The decode step counts a reuse loop once for every layer (`count_reuse`); the counts are
    those of each layer's wise_attention(count=True): layers with complete, foreign and partial
    discovery, and a masked row. Exact: integer counts far below 2**24 in float32."""
    k, v, table = cache
    rng = np.random.default_rng(5)
    layers, n_blocks = 3, table.shape[1] * PAGE // WISE.block_size
    seq_lens, tags = jnp.asarray([70, 120], jnp.int32), jnp.asarray([4, 9], jnp.int32)
    state = ws.create(WISE, slots=2, layers=layers, heads=HEADS, max_blocks=n_blocks)
    state = dataclasses.replace(
        state, support=jnp.asarray(rng.random((layers, 2, HEADS, n_blocks)) < 0.5).at[..., 0].set(True),
        tag=jnp.asarray([[4, 9], [4, 8], [4, 9]], jnp.int32),               # layer 1 row 1: another tag's
        tag_position=jnp.asarray([[69, 119], [69, 119], [69, 119]], jnp.int32),
        depths_run=jnp.asarray([[3, 3], [3, 3], [1, 3]], jnp.int32))        # layer 2 row 0: depth 1 did not run
    q = jnp.asarray(rng.standard_normal((2, HEADS, DIM)), jnp.float32)
    for active in ([True, True], [True, False]):
        active = jnp.asarray(active)
        layer_by_layer = state
        for layer in range(layers):
            _, layer_by_layer = ws.wise_attention(layer_by_layer, WISE, 2, jnp.int32(layer), q, k, v, table,
                                                  seq_lens, tags, active, kernel="reference")
        at_once = ws.count_reuse(state, WISE, 2, seq_lens, tags, active, n_blocks)
        assert int(at_once.fallbacks) == int(layer_by_layer.fallbacks) == 2 + int(active[1]) - 1
        assert np.array_equal(at_once.selected_blocks, layer_by_layer.selected_blocks)
        assert np.array_equal(at_once.causal_blocks, layer_by_layer.causal_blocks)
        assert float(at_once.causal_blocks[0]) > 0 and float(at_once.selected_blocks[1]) == 0


def _at_loop_layer_head(mass, ctx):
    """A context rule: the block (loop + layer + head) mod the blocks, and each row's newest."""
    newest = (ctx.seq_lens - 1) // ctx.block_size
    chosen = ctx.block[None, None, :] == (ctx.loop + ctx.layer + ctx.head[None, :, None]) % mass.shape[-1]
    return chosen | (ctx.block[None, None, :] == newest[:, None, None])


def test_a_context_rule_reads_the_loop_layer_heads_and_rows_of_the_call(cache):
    """wise_attention hands a Custom(..., context=True) rule this call's SelectionContext (the
    loop and a traced layer as arrays): the support is the numpy reference's with that context."""
    from wise_core import reference
    from wise_core.selection import Custom, SelectionContext
    k, v, table = cache
    rule = Custom(_at_loop_layer_head, "loop-layer-head", context=True)
    wise = WiseConfig(selection=rule)
    lens, tags = jnp.asarray([100, 57], jnp.int32), jnp.asarray([7, 8], jnp.int32)
    state = ws.create(wise, slots=2, layers=2, heads=HEADS, max_blocks=4)

    @jax.jit
    def discover(state, q, layer):
        return ws.wise_attention(state, wise, 1, layer, q, k, v, table, lens, tags, jnp.ones(2, bool),
                                 kernel="reference")[1]

    state = discover(state, _q(3), jnp.int32(LAYER))
    _, _, mass = decode_attention_reference(_q(3), k, v, table, lens, _modes(M.DISCOVER, M.DISCOVER),
                                            jnp.zeros((2, HEADS, 4), bool), block_size=32, eta=0.95, return_mass=True)
    context = SelectionContext(seq_lens=np.asarray(lens), loop=np.int32(1), layer=np.int32(LAYER),
                               head=np.arange(HEADS, dtype=np.int32), block=np.arange(4, dtype=np.int32), block_size=32)
    want = reference.select_blocks(np.asarray(mass), rule, context)
    np.testing.assert_array_equal(np.asarray(state.support[LAYER]), want)
    assert not np.array_equal(want, reference.select_blocks(np.asarray(mass), rule,
                                                            dataclasses.replace(context, loop=np.int32(0))))
