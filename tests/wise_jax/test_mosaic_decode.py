"""The Mosaic GPU split kernel (wise_jax.kernels.mosaic_decode): in jax's GPU interpreter on a
CPU, lowered for CUDA (Mosaic GPU, sm90) without a GPU, and compiled and run on a GPU.

The equivalences are test_pallas_decode.py's (`check_modes`: every mode against the float64
reference within `wise_core.rounding`'s bounds, the bitwise ones bitwise), plus the dense output
against the Triton-lowered Pallas kernel within the sum of the two kernels' bounds (each rounds;
bf16 outputs).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_pallas_decode import (BLOCK, COMBOS, ETA, GPU_COMBOS, assert_within, bits, check_modes,
                                check_stale_nan_unread, make_case, on_gpu, out_bound, run)
from wise_core import modes as M
from wise_jax.kernels import mosaic_decode, pallas_decode
from wise_jax.kernels.mosaic_decode import MosaicConfig

mosaic = mosaic_decode.decode_attention
# Interpreted, the products are the reductions (the interpreter does not run the mma.sync code):
# said here so that the bounds (out_bound: config.dots) are the reductions' f32 probabilities.
RING = MosaicConfig(tile_n=64, split_keys=128, num_stages=1, products="reduce")  # 2 tiles a split, one slot
SPLITS = MosaicConfig(tile_n=64, split_keys=256, min_splits=3, num_stages=2,
                      products="reduce")  # 6 blocks: 3 splits
MOSAIC_COMBOS = [name for name, spec in COMBOS.items()
                 if mosaic_decode.supports(spec["head_dim"], spec["dtype"])]


@pytest.mark.parametrize("name,config", [(MOSAIC_COMBOS[0], RING), (MOSAIC_COMBOS[1], SPLITS)])
def test_interpreted_modes_against_references_and_dense(name, config):
    check_modes(COMBOS[name], config=config, impl=mosaic)


def test_interpreted_dense_matches_triton_lowering_and_rows_alone():
    """Dense (and every mode) against the Triton-lowered kernel: outputs within both bounds,
    the same selection; each row of a mixed batch bitwise as alone; jit bitwise eager."""
    case = make_case(3, **COMBOS[MOSAIC_COMBOS[0]])
    modes = [M.SPARSE, M.DISCOVER, M.DENSE, M.DISCOVER_UNION]
    out, support, mass = run(case, modes, impl=mosaic, config=RING)
    ref_out, ref_support, _ = run(case, modes)
    for b in range(4):  # both kernels round: twice each bound
        assert_within(np.asarray(out[b].astype(jnp.float32)), np.asarray(ref_out[b].astype(jnp.float32)),
                      2 * out_bound(case, b), f"row {b}")
    assert np.array_equal(np.asarray(support), np.asarray(ref_support))
    b = 3  # a discovery row alone
    alone = {name: (x[b:b + 1] if name not in ("k", "v") else x) for name, x in case.items()}
    out_b, support_b, mass_b = run(alone, [modes[b]], impl=mosaic, config=RING)
    for x, y in ((out_b, out), (support_b, support), (mass_b, mass)):
        assert np.array_equal(bits(x[0]), bits(y[b]))
    call = functools.partial(mosaic, block_size=BLOCK, eta=ETA, return_mass=True, config=RING)
    args = (case["q"], case["k"], case["v"], case["page_table"], case["seq_lens"],
            jnp.asarray(modes, jnp.int32), case["support"])
    for x, y in zip(jax.jit(call)(*args), (out, support, mass)):
        assert np.array_equal(bits(x), bits(y))


def test_interpreted_rows_bitwise_one_row():
    """MosaicConfig(rows): a program attending 2 or 4 heads, their tiles through one ring, gives
    every output bitwise as one head a program (each head keeps its splits and arithmetic), in
    every mode, with several splits a row, one-slot rings and rows without a split s."""
    case = make_case(8, **COMBOS[MOSAIC_COMBOS[0]])
    modes = [M.SPARSE, M.DISCOVER, M.DENSE, M.DISCOVER_UNION]
    for config, rows in ((RING, 2), (SPLITS, 4)):
        one = run(case, modes, impl=mosaic, config=config)
        several = run(case, modes, impl=mosaic, config=dataclasses.replace(config, rows=rows))
        for x, y in zip(several, one):
            assert np.array_equal(bits(x), bits(y)), (config, rows)


def test_interpreted_nan_past_a_rows_keys_never_reaches_it():
    """A row whose keys end inside its last block: the block's ring slot holds the slots past
    them too (a whole-block copy), which the kernel zeroes before p.V."""
    check_stale_nan_unread(dict(COMBOS[MOSAIC_COMBOS[0]], max_pages=2, seq_lens=[97, 70, 65]), impl=mosaic,
                           config=RING)


def test_interpreted_unvalidated_empty_sparse_head_is_nan():
    """docs/DESIGN.md: a SPARSE head that selects no causal block is outside the contract;
    unvalidated, its output is NaN (the softmax of no keys) and the other heads' are as with
    the head selecting a block, with one head a program and with several."""
    case = make_case(9, **COMBOS[MOSAIC_COMBOS[0]])
    modes = [M.DENSE, M.SPARSE, M.SPARSE, M.DISCOVER]
    empty = np.array(case["support"])
    empty[1, 1] = False
    for config in (RING, dataclasses.replace(RING, rows=4)):
        out, support, _ = run(case, modes, jnp.asarray(empty), impl=mosaic, config=config,
                              validate=False)
        held, _, _ = run(case, modes, impl=mosaic, config=config)
        out, held = np.asarray(out.astype(jnp.float32)), np.asarray(held.astype(jnp.float32))
        assert np.isnan(out[1, 1]).all(), config
        others = np.ones(out.shape[:2], bool)
        others[1, 1] = False
        assert np.array_equal(out[others], held[others]), config
        assert np.array_equal(np.asarray(support[1]), empty[1]), config


def test_list_kernel_against_numpy():
    """pallas_decode._list_kernel (the Mosaic path's list when interpreted or with list_launch):
    per (row, head) the listed blocks' cache blocks in order, their count and the valid keys of
    the last one, for every mode, partial last blocks and rows shorter than the table."""
    rng = np.random.default_rng(3)
    batch, heads, page_size, max_pages = 5, 3, 64, 4
    per_page, n_blocks = page_size // BLOCK, max_pages * page_size // BLOCK
    page_table = rng.permutation(batch * max_pages).reshape(batch, max_pages).astype(np.int32)
    seq_lens = np.array([256, 1, 100, 33, 190], np.int32)
    modes = np.array([M.SPARSE, M.DENSE, M.SPARSE, M.DISCOVER, M.DISCOVER_UNION], np.int32)
    support = rng.random((batch, heads, n_blocks)) < 0.4
    row_len = 32
    rows, meta = pallas_decode._list_call(
        jnp.asarray(page_table), jnp.asarray(seq_lens), jnp.asarray(modes), jnp.asarray(support),
        block_size=BLOCK, page_size=page_size, row_len=row_len, interpret=True)
    rows, meta = np.asarray(rows), np.asarray(meta)
    assert rows.shape == (batch, heads, row_len) and meta.shape == (batch, heads, 2)
    for b in range(batch):
        n_causal = -(-seq_lens[b] // BLOCK)
        for h in range(heads):
            blocks = [j for j in range(n_causal) if modes[b] != M.SPARSE or support[b, h, j]]
            want = [page_table[b, j // per_page] * per_page + j % per_page for j in blocks]
            last = blocks[-1] == n_causal - 1 if blocks else False
            tail = seq_lens[b] - (n_causal - 1) * BLOCK if last else BLOCK
            assert list(meta[b, h]) == [len(blocks), tail], (b, h)
            assert list(rows[b, h, :len(blocks)]) == want, (b, h)


def test_rejects_what_it_does_not_take():
    case = make_case(6, **COMBOS["page32-mha-d64-f32"])  # float32
    with pytest.raises(ValueError, match="16-bit q/K/V"):
        run(case, [M.DENSE] * 4, impl=mosaic, config=RING)
    with pytest.raises(ValueError, match="MosaicConfig"):
        MosaicConfig(tile_n=32)
    for gone in ("dots", "wgmma"):   # wgmma is not a product (docs/kernels/mosaic_decode.md)
        with pytest.raises(ValueError, match="MosaicConfig.products must be one of"):
            MosaicConfig(products=gone)
    with pytest.raises(ValueError, match="MosaicConfig.list_launch"):
        MosaicConfig(list_launch="no")
    with pytest.raises(ValueError, match="MosaicConfig.rows"):
        MosaicConfig(rows=3)
    with pytest.raises(ValueError, match=r"rows \(4\) must divide the heads \(2\)"):
        run(make_case(6, **COMBOS["page128-gqa-d64-bf16"]), [M.DENSE] * 4, impl=mosaic,
            config=MosaicConfig(rows=4))


def test_kernel_choice_in_one_place(monkeypatch):
    """kernel='pallas' runs the Triton-lowered kernel unless the call is on sm90 with what the
    Mosaic kernel takes (`wise_jax.kernels.choice`)."""
    from wise_jax.attention import decode_attention as dispatch
    from wise_jax.kernels import choice
    case = make_case(5, **COMBOS[MOSAIC_COMBOS[0]])
    args = (case["q"], case["k"], case["v"], case["page_table"], case["seq_lens"],
            jnp.zeros(4, jnp.int32), case["support"])
    calls = []
    monkeypatch.setattr(mosaic_decode, "decode_attention",
                        lambda *a, **k: calls.append(("mosaic", k["reuse"])))
    monkeypatch.setattr(pallas_decode, "decode_attention",
                        lambda *a, **k: calls.append(("triton", k["reuse"])))
    dispatch(*args, block_size=BLOCK, eta=ETA, kernel="pallas", reuse=True)
    dispatch(*args, block_size=BLOCK, eta=ETA, kernel="pallas")  # not on sm90 here
    monkeypatch.setattr(choice, "on_sm90", lambda: True)
    dispatch(*args, block_size=BLOCK, eta=ETA, kernel="pallas", reuse=True)
    dispatch(*args, block_size=BLOCK, eta=ETA, kernel="pallas")
    f32 = {name: x.astype(jnp.float32) for name, x in case.items() if name in ("q", "k", "v")}
    dispatch(f32["q"], f32["k"], f32["v"], *args[3:], block_size=BLOCK, eta=ETA, kernel="pallas")
    # the reuse flag reaches the kernel that runs
    assert calls == [("triton", True), ("triton", False), ("mosaic", True), ("mosaic", False),
                     ("triton", False)]


def test_launch_config_groups_heads_only_where_it_pays():
    """`launch_config`: for a reuse call, the mma products, rows > 1 only where rows are one
    split each, the count its wave rule gives (the H200 shapes of its docstring, 132 SMs), and
    rows of several splits get SPARSE_SPLIT_KEYS keys a split; other calls or no SM count:
    MosaicConfig()."""
    def config(batch, ctx, heads=16, reuse=True, n_sm=132):
        return mosaic_decode.launch_config(batch, heads, ctx // 32, block_size=32, reuse=reuse,
                                           n_sm=n_sm)

    assert [config(b, 1024).rows for b in (32, 48, 64, 128)] == [2, 1, 4, 4]
    assert config(1, 1024) == MosaicConfig(products="mma")  # tensor cores for every reuse call
    long_splits = MosaicConfig(split_keys=mosaic_decode.SPARSE_SPLIT_KEYS, products="mma")
    assert long_splits.split_keys > MosaicConfig().split_keys
    assert [config(64, 2048), config(20, 4096), config(10, 8192)] == [long_splits] * 3
    assert config(64, 1024, reuse=False) == MosaicConfig()
    assert config(64, 1024, n_sm=None) == MosaicConfig()
    assert config(20, 4096, reuse=False) == config(20, 4096, n_sm=None) == MosaicConfig()
    assert config(64, 1024, heads=6).rows == 2  # 384 rows: one wave of two a program, not two of one


def test_reuse_runs_the_launch_config(monkeypatch):
    """decode_attention given no config runs `launch_config`'s (the SMs as `sm_count` says;
    interpreted: none, one row a program); an explicit config wins."""
    case = make_case(5, **COMBOS[MOSAIC_COMBOS[0]])
    args = (case["q"], case["k"], case["v"], case["page_table"], case["seq_lens"],
            jnp.full(4, M.SPARSE, jnp.int32), case["support"])
    heads = case["q"].shape[1]
    seen = []
    monkeypatch.setattr(mosaic_decode, "_decode", lambda *a, config, **k: seen.append(config.rows) or ())
    mosaic(*args, block_size=BLOCK, eta=ETA, interpret=True, reuse=True)
    monkeypatch.setattr(mosaic_decode, "sm_count", lambda interpret: 1)
    mosaic(*args, block_size=BLOCK, eta=ETA, interpret=True, reuse=True)
    mosaic(*args, block_size=BLOCK, eta=ETA, interpret=True)
    mosaic(*args, block_size=BLOCK, eta=ETA, interpret=True, reuse=True, config=MosaicConfig())
    expected = mosaic_decode.launch_config(4, heads, case["support"].shape[-1], block_size=BLOCK,
                                           reuse=True, n_sm=1).rows
    assert expected > 1 and seen == [1, expected, 1, 1]


REUSE_MODES = [M.SPARSE, M.DENSE, M.SPARSE, M.SPARSE, M.DENSE, M.SPARSE, M.SPARSE, M.DENSE]


def check_reuse(case, config, *, bitwise_rows, bound_config=None):
    """A reuse call (rows SPARSE or DENSE) against the same launch as a plain call: support'
    is the support held and the mass zeros, bitwise as the plain call's for such rows; outputs
    bitwise in bitwise_rows (rows of one split: the split kernel writes them either way), else
    within twice the output bound (both round the same splits' partials, merged in another
    order). A DISCOVER row: the call's check rejects it; unchecked, its output is NaN and the
    other rows' are unchanged."""
    modes = REUSE_MODES[:len(case["seq_lens"])]
    plain = run(case, modes, impl=mosaic, config=config)
    reused = run(case, modes, impl=mosaic, config=config, reuse=True)
    assert np.array_equal(np.asarray(reused[1]), np.asarray(case["support"]))
    assert np.array_equal(np.asarray(reused[1]), np.asarray(plain[1]))
    assert not np.asarray(reused[2]).any() and not np.asarray(plain[2]).any()
    for b in range(len(modes)):
        got, want = np.asarray(reused[0][b].astype(jnp.float32)), np.asarray(plain[0][b].astype(jnp.float32))
        if b in bitwise_rows:
            assert np.array_equal(bits(reused[0][b]), bits(plain[0][b])), f"row {b}"
        else:
            assert_within(got, want, 2 * out_bound(case, b, bound_config or config), f"row {b}")
    discovering = list(modes)
    discovering[1] = M.DISCOVER
    with pytest.raises(ValueError, match=r"reuse call must be SPARSE or DENSE: rows \[1\]"):
        run(case, discovering, impl=mosaic, config=config, reuse=True)
    unchecked = run(case, discovering, impl=mosaic, config=config, reuse=True, validate=False)
    assert np.isnan(np.asarray(unchecked[0][1].astype(jnp.float32))).all()
    rest = [b for b in range(len(modes)) if b != 1]
    assert np.array_equal(bits(unchecked[0][np.asarray(rest)]), bits(reused[0][np.asarray(rest)]))


def test_interpreted_reuse_against_plain():
    """Interpreted, a reuse call's splits are merged by the finish launch as a plain call's:
    every output bitwise the plain call's (rows of three splits included)."""
    case = make_case(6, **COMBOS[MOSAIC_COMBOS[1]])
    check_reuse(case, SPLITS, bitwise_rows=range(len(case["seq_lens"])))


def lower_for_cuda(batch, ctx, config, heads=16, head_dim=128, page_size=128, reuse=False):
    """Lower an Ouro-shaped call for CUDA (no GPU needed): the Mosaic GPU module is built."""
    max_pages, n_blocks = ctx // page_size, ctx // BLOCK
    kv = jax.ShapeDtypeStruct((batch * max_pages, page_size, heads, head_dim), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((batch, heads, head_dim), jnp.bfloat16), kv, kv,
            jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch, heads, n_blocks), jnp.bool_))

    def call(*a):  # validate=False: an engine's decode step (a host callback is not lowered)
        return mosaic(*a, block_size=BLOCK, eta=ETA, return_mass=True, interpret=False,
                      config=config, validate=False, reuse=reuse)

    return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="cross-lowering is checked on a CPU machine")
@pytest.mark.parametrize("batch,ctx,config", [(64, 1024, MosaicConfig()),
                                              (10, 8192, MosaicConfig(tile_n=128, split_keys=1024,
                                                                      min_splits=4, num_stages=2)),
                                              (64, 1024, MosaicConfig(rows=4)),
                                              (20, 4096, MosaicConfig(rows=2, min_splits=3)),
                                              (20, 4096, MosaicConfig(products="mma")),
                                              (64, 1024, MosaicConfig(rows=4, products="mma")),
                                              (10, 8192, MosaicConfig(tile_n=128, split_keys=2048,
                                                                      products="mma"))])
def test_lowers_to_mosaic_gpu(batch, ctx, config):
    text = lower_for_cuda(batch, ctx, config)
    calls = collections.Counter(re.findall(r"custom_call @(\w+)", text))
    # The split kernel (listing its blocks itself) and the Triton-lowered finish.
    assert calls == {"mosaic_gpu_v2": 1, "__gpu": 1}, calls
    assert "wise_decode_list" not in text and "wise_decode_finish" in text
    # The mma products' inline PTX is in the Mosaic GPU module (serialized in the custom call).
    for ptx in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned.m8n8.x4.trans"):
        assert (ptx in text) == (config.products == "mma"), ptx
    assert "atom.acq_rel.gpu" not in text


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="cross-lowering is checked on a CPU machine")
@pytest.mark.parametrize("batch,ctx,config", [(64, 1024, MosaicConfig(rows=4, products="mma")),
                                              (10, 8192, MosaicConfig(split_keys=2048, products="mma")),
                                              (20, 4096, MosaicConfig(min_splits=3))])
def test_reuse_lowers_to_one_launch(batch, ctx, config):
    """A reuse call on a GPU is the split kernel alone: its rows' splits merge in it (the
    atomic count of `_arrive`), no finish launch."""
    text = lower_for_cuda(batch, ctx, config, reuse=True)
    calls = collections.Counter(re.findall(r"custom_call @(\w+)", text))
    assert calls == {"mosaic_gpu_v2": 1}, calls
    assert "wise_decode_finish" not in text and "atom.acq_rel.gpu.global.add.u32" in text


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="cross-lowering is checked on a CPU machine")
def test_lowers_with_list_launch():
    text = lower_for_cuda(20, 4096, MosaicConfig(list_launch=True))
    calls = collections.Counter(re.findall(r"custom_call @(\w+)", text))
    assert calls == {"mosaic_gpu_v2": 1, "__gpu": 2}, calls
    assert "wise_decode_list" in text and "wise_decode_finish" in text


# ------------------------------------------------------------------------------------------------
# On a GPU (the products ran on an H200 on 2026-12-03).
#
# Every kernel variant compiles on the GPU (about 9 s each on an H100, 2026-12-07: the first 8 tests
# of this file took 100 s), so each test compiles only the variants no other test covers; what was
# cut (issue 46), and where each code path still runs:
# - the products (reduce, mma) against the float64 references in every mode, on both head
#   layouts: test_gpu_modes_against_references_and_dense, all four, kept whole;
# - against the Triton-lowered kernel, repeatably and rows alone: the two products, reduce (the
#   default: plain calls) and mma (reuse launches);
# - the in-kernel list against the list launch: the default products only (the list is made
#   before any product runs; test_gpu_rows_bitwise_one_row compares both list routes under both
#   products);
# - rows of several heads a program: one (head layout, products) pair each, (MHA, reduce) and
#   (GQA, mma) -- GQA with grouped rows under mma is also what test_gpu_reuse_bitwise_plain_launch
#   runs -- and rows=2 with the in-kernel list, rows=4 with the list launch, not every pairing;
# - the split rules of both: one split a row (MosaicConfig()) and several with empty ones for
#   short rows (min_splits=3); several splits by size (split_keys=256) runs in
#   test_gpu_reuse_merges_in_the_split_kernel[mma];
# - the reuse merge: one split rule per products, (reduce, min_splits=3) and (mma, split_keys=256).

GPU_MOSAIC = [name for name, spec in GPU_COMBOS.items()
              if mosaic_decode.supports(spec["head_dim"], spec["dtype"])]
GPU_CONFIGS = {products: MosaicConfig(products=products) for products in mosaic_decode.PRODUCTS}
GPU_MODES = [M.SPARSE, M.DISCOVER, M.DENSE, M.DISCOVER_UNION, M.SPARSE, M.DENSE, M.SPARSE, M.DISCOVER]
SPLIT_RULES = (MosaicConfig(), MosaicConfig(min_splits=3))   # one split a row; several, some empty


@pytest.mark.parametrize("kind", list(GPU_CONFIGS))
@pytest.mark.parametrize("name", GPU_MOSAIC)
@on_gpu
def test_gpu_modes_against_references_and_dense(name, kind):
    check_modes(GPU_COMBOS[name], config=GPU_CONFIGS[kind], exact=False, impl=mosaic)


@pytest.mark.parametrize("kind", list(GPU_CONFIGS))
@on_gpu
def test_gpu_nan_past_a_rows_keys_never_reaches_it(kind):
    """Each products path zeroes the values past a row's keys in the slot of its last block (the
    interpreted test runs the reductions only)."""
    check_stale_nan_unread(GPU_COMBOS["ouro-page128-d128-bf16"], impl=mosaic, config=GPU_CONFIGS[kind])


@pytest.mark.parametrize("products", ["reduce", "mma"])
@on_gpu
def test_gpu_matches_triton_lowering_repeatably_and_rows_alone(products):
    case = make_case(7, **GPU_COMBOS["ouro-page128-d128-bf16"])
    modes = [M.SPARSE, M.DISCOVER, M.DENSE, M.DISCOVER_UNION] * 2
    config = MosaicConfig(min_splits=4, num_stages=2, products=products)
    out, support, mass = run(case, modes, impl=mosaic, config=config)
    for again in [run(case, modes, impl=mosaic, config=config) for _ in range(3)]:
        for x, y in zip((out, support, mass), again):
            assert np.array_equal(bits(x), bits(y))
    triton_config = pallas_decode.config_for(128, jnp.bfloat16)
    ref_out, _, _ = run(case, modes, config=triton_config)
    for b in range(len(modes)):  # both kernels round: the sum of their bounds
        bound = out_bound(case, b, config) + out_bound(case, b, triton_config)
        assert_within(np.asarray(out[b].astype(jnp.float32)), np.asarray(ref_out[b].astype(jnp.float32)),
                      bound, f"row {b}")
    for b in (0, 1):
        alone = {name: (x[b:b + 1] if name not in ("k", "v") else x) for name, x in case.items()}
        out_b, support_b, mass_b = run(alone, [modes[b]], impl=mosaic, config=config)
        assert np.array_equal(bits(out_b[0]), bits(out[b]))
        assert np.array_equal(np.asarray(support_b[0]), np.asarray(support[b]))


@pytest.mark.parametrize("name", GPU_MOSAIC)
@on_gpu
def test_gpu_list_in_kernel_bitwise_list_launch(name):
    """The split kernel listing its blocks itself (`_list_in_kernel`, raw Mosaic GPU code the
    interpreter does not run) against the list launch the interpreted tests cover: the same
    lists, so every output bitwise, in every mode, with partial last blocks, short rows, several
    splits a row and scattered pages (make_case)."""
    case, modes = make_case(11, **GPU_COMBOS[name]), GPU_MODES
    for config in SPLIT_RULES:
        launched = run(case, modes, impl=mosaic, config=dataclasses.replace(config, list_launch=True))
        in_kernel = run(case, modes, impl=mosaic, config=config)
        for x, y in zip(in_kernel, launched):
            assert np.array_equal(bits(x), bits(y)), config


@pytest.mark.parametrize("name,products", [("ouro-page128-d128-bf16", "reduce"), ("gqa-page64-d128-bf16", "mma")])
@on_gpu
def test_gpu_rows_bitwise_one_row(name, products):
    """MosaicConfig(rows=2) with the in-kernel list and rows=4 with the list launch against one
    head a program: every output bitwise, in every mode (the interpreted test covers the list
    launch only)."""
    case, modes = make_case(12, **GPU_COMBOS[name]), GPU_MODES
    for config in SPLIT_RULES:
        config = dataclasses.replace(config, products=products)
        one = run(case, modes, impl=mosaic, config=config)
        for rows, list_launch in ((2, False), (4, True)):
            several = run(case, modes, impl=mosaic, config=dataclasses.replace(
                config, rows=rows, list_launch=list_launch))
            for x, y in zip(several, one):
                assert np.array_equal(bits(x), bits(y)), (config, rows, list_launch)


OURO_1K = dict(GPU_COMBOS["ouro-page128-d128-bf16"], max_pages=8,
               seq_lens=[1024, 1000, 513, 64, 1023, 700, 900, 31])


@pytest.mark.parametrize("spec", [OURO_1K, GPU_COMBOS["gqa-page64-d128-bf16"]], ids=["ouro-1k", "gqa"])
@on_gpu
def test_gpu_reuse_bitwise_plain_launch(spec, monkeypatch):
    """The GPU reports its SMs; a reuse call, its launch grouping heads (one SM assumed, so that
    these small batches group) and merging in the split kernel, gives every output bitwise the
    same products' plain launch of one head a program (every row one split)."""
    assert mosaic_decode.sm_count(False) > 0
    case, modes = make_case(13, **spec), REUSE_MODES
    plain = run(case, modes, impl=mosaic, config=MosaicConfig(products="mma"))
    monkeypatch.setattr(mosaic_decode, "sm_count", lambda interpret: 1)
    grouped = mosaic_decode.launch_config(len(modes), spec["heads"], case["support"].shape[-1],
                                          block_size=BLOCK, reuse=True, n_sm=1)
    assert grouped == MosaicConfig(products="mma", rows=grouped.rows) and grouped.rows > 1
    reused = run(case, modes, impl=mosaic, config=None, reuse=True)
    for x, y in zip(reused, plain):
        assert np.array_equal(bits(x), bits(y))


@pytest.mark.parametrize("config", [MosaicConfig(min_splits=3, products="reduce"),
                                    MosaicConfig(split_keys=256, products="mma")], ids=["reduce", "mma"])
@on_gpu
def test_gpu_reuse_merges_in_the_split_kernel(config):
    """Rows of several splits (min_splits=3; or DENSE rows of 2048 keys at 256 a split) merged
    by their last split (`_merge`: the atomic count, the partials of the other programs): within
    twice the bound of the finish's merge, rows of one split bitwise; a DISCOVER row rejected,
    or NaN unchecked; repeated calls bitwise (the counts start at zero each launch)."""
    case = make_case(15, **GPU_COMBOS["ouro-page128-d128-bf16"])
    check_reuse(case, config, bitwise_rows=())
    first = run(case, REUSE_MODES, impl=mosaic, config=config, reuse=True)
    for _ in range(3):
        again = run(case, REUSE_MODES, impl=mosaic, config=config, reuse=True)
        for x, y in zip(first, again):
            assert np.array_equal(bits(x), bits(y)), config


@on_gpu
def test_gpu_reuse_long_splits():
    """Rows past one split (2048-key contexts) in a reuse call: the launch has the mma products
    and SPARSE_SPLIT_KEYS-key splits (every row one split here: bitwise that config given
    explicitly in a plain call), and every mode is within the references' bounds with it."""
    spec = GPU_COMBOS["ouro-page128-d128-bf16"]
    config = MosaicConfig(split_keys=mosaic_decode.SPARSE_SPLIT_KEYS, products="mma")
    case = make_case(14, **spec)
    assert mosaic_decode.launch_config(len(REUSE_MODES), spec["heads"], case["support"].shape[-1],
                                       block_size=BLOCK, reuse=True,
                                       n_sm=mosaic_decode.sm_count(False)) == config
    check_modes(spec, config=config, exact=False, impl=mosaic)
    reused = run(case, REUSE_MODES, impl=mosaic, config=None, reuse=True)
    explicit = run(case, REUSE_MODES, impl=mosaic, config=config)
    for x, y in zip(reused, explicit):
        assert np.array_equal(bits(x), bits(y))
