"""wise_core.split_plan: its invariants over many row widths and launch shapes, and every
split-KV launcher's split sizes and grid equal to it (host sizing functions and the device rule,
the Triton one in the interpreter; no GPU)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from wise_core import split_plan
from wise_core.split_plan import max_splits, split_count, split_size, split_units
from wise_jax.kernels import mosaic_decode, pallas_decode
from wise_torch.kernels import triton_decode, triton_verify
from wise_torch.kernels.triton_splits import splits

# (tile_n, split_keys) in keys, block sizes, min_splits: the launch tables' shapes and smaller.
LAUNCHES = [(16, 16), (16, 64), (32, 256), (64, 512), (128, 1024), (64, 1024), (128, 256)]
BLOCKS = [1, 16, 32, 64]
MIN_SPLITS = [1, 2, 3, 4, 16]


def cdiv(a, b):
    return -(-a // b)


def test_plan_covers_each_key_once_in_even_block_aligned_splits():
    """For every width up to 40 splits' worth: the splits cut [0, n_keys) in order, each key
    once; every cut is on a tile (so on a block: no WISE block straddles two splits); each
    split holds at most split_keys keys (rounded up to a block); every split but the last has
    one size, the last at most that and not empty; that size is the fewest whole tiles with
    which `count` splits cover the row (no plan of as many splits has a shorter longest one);
    count is the fewest splits of at most split_keys, or up to min_splits for a short row."""
    checked = 0
    for (tile_n, split_keys), block, m in itertools.product(LAUNCHES, BLOCKS, MIN_SPLITS):
        tile, split = split_units(block, tile_n, split_keys)
        tile_keys = tile * block
        for n_keys in sorted({*range(0, 3 * split * block + 2, max(block // 4, split * block // 64, 1)),
                              *range(0, 40 * split * block, split * block // 2 + 1)}):
            plan = split_plan.split_plan(n_keys, tile_n=tile_n, split_keys=split_keys, min_splits=m,
                                         block_size=block)
            lo, hi = plan[:, 0], plan[:, 1]
            n = cdiv(n_keys, block)
            count = split_count(n, tile=tile, split=split, min_splits=m)
            assert plan.shape == (count, 2) and count >= 1
            assert lo[0] == 0 and hi[-1] == n_keys and np.array_equal(lo[1:], hi[:-1])
            assert np.all(lo % tile_keys == 0)
            if n_keys == 0:
                assert count == 1
                continue
            sizes = hi - lo
            size = split_size(n, tile=tile, split=split, min_splits=m) * block
            assert np.all(sizes[:-1] == size) and 0 < sizes[-1] <= size <= split * block
            assert size == tile_keys * cdiv(n, count * tile)
            fewest = cdiv(n, split)
            assert count == fewest if fewest >= m else fewest <= count <= min(m, cdiv(n, tile))
            checked += 1
    assert checked > 5_000


@pytest.mark.parametrize("tile,split,m", [(1, 1, 1), (1, 4, 1), (2, 16, 1), (2, 16, 16), (4, 8, 3),
                                          (2, 32, 4), (8, 8, 2)])
def test_max_splits_is_the_most_any_narrower_row_gets(tile, split, m):
    most = 0
    for n in range(0, 40 * split):
        most = max(most, split_count(n, tile=tile, split=split, min_splits=m))
        assert max_splits(n, tile=tile, split=split, min_splits=m) == most, n


@pytest.mark.parametrize("n_keys,block,tile_n,split_keys,m,sizes", [
    (33 * 32, 32, 64, 1024, 1, [18 * 32, 15 * 32]),  # even whole tiles, not 32 + 1 blocks
    (150, 32, 32, 128, 1, [96, 54]),  # 3 + 2 blocks, the last partial (the old Triton rule: 4 + 1)
    (9 * 32, 32, 32, 128, 1, [96] * 3),  # 3 + 3 + 3 blocks (the old Triton rule: 4 + 4 + 1)
    (80, 1, 16, 64, 1, [48, 32]),  # keys (verification): the old Triton rule 64 + 16
    (6 * 32, 32, 32, 256, 3, [64] * 3),  # min_splits
    (3 * 32, 32, 64, 256, 4, [64, 32]),  # fewer tiles than min_splits: a tile each
    (7 * 32, 32, 64, 1024, 3, [128, 96]),  # 3 wanted; whole tiles of 2 blocks give 4 + 3
    (1, 32, 64, 512, 1, [1]),
    (0, 32, 64, 512, 1, [0]),  # an empty row: one split without keys
])
def test_plan_examples(n_keys, block, tile_n, split_keys, m, sizes):
    plan = split_plan.split_plan(n_keys, tile_n=tile_n, split_keys=split_keys, min_splits=m, block_size=block)
    assert (plan[:, 1] - plan[:, 0]).tolist() == sizes


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="whole number of tiles"):
        split_size(8, tile=4, split=6)
    with pytest.raises(ValueError, match="min_splits must be a positive integer"):
        split_size(8, tile=2, split=4, min_splits=0)
    with pytest.raises(ValueError, match="n must be a non-negative integer"):
        split_count(-1, tile=2, split=4)
    with pytest.raises(ValueError, match="max_n must be a non-negative integer"):
        max_splits(4.0, tile=2, split=4)
    with pytest.raises(ValueError, match="tile must be a positive integer"):
        max_splits(4, tile=True, split=4)
    with pytest.raises(ValueError, match="block_size must be a positive power of two"):
        split_units(48, 64, 512)
    with pytest.raises(ValueError, match="n_keys must be a non-negative integer"):
        split_plan.split_plan(-3, tile_n=16, split_keys=64)


# ------------------------------------------------------------------------------------------------
# The launchers: host sizing (grid, workspaces) and the device rule equal the plan.

RULES = [(1, 1, 1), (1, 4, 1), (2, 16, 1), (2, 16, 16), (4, 8, 3), (2, 32, 4), (4, 32, 8), (1, 2, 3)]
WIDTHS = np.arange(0, 300, dtype=np.int32)


def plan_sizes(tile, split, m):
    return ([split_size(int(n), tile=tile, split=split, min_splits=m) for n in WIDTHS],
            [split_count(int(n), tile=tile, split=split, min_splits=m) for n in WIDTHS])


@triton.jit
def _rule_kernel(n_ptr, size_ptr, count_ptr, N: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
                 MIN_SPLITS: tl.constexpr):
    offs = tl.arange(0, N)
    size, count = splits(tl.load(n_ptr + offs), TILE, SPLIT, MIN_SPLITS)
    tl.store(size_ptr + offs, size)
    tl.store(count_ptr + offs, count)


@pytest.mark.cuda
def test_triton_device_rule_is_the_plan():
    """triton_splits.splits (decode: n in blocks; verification: in keys) in the interpreter
    or on the GPU, for widths 0..299 and several rules."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = torch.zeros(512, dtype=torch.int32, device=device)
    n[:len(WIDTHS)] = torch.from_numpy(WIDTHS)
    for tile, split, m in RULES:
        size, count = torch.empty_like(n), torch.empty_like(n)
        _rule_kernel[(1,)](n, size, count, N=512, TILE=tile, SPLIT=split, MIN_SPLITS=m)
        want_size, want_count = plan_sizes(tile, split, m)
        assert size[:len(WIDTHS)].tolist() == want_size, (tile, split, m)
        assert count[:len(WIDTHS)].tolist() == want_count, (tile, split, m)


@pytest.mark.parametrize("tile_n,split_keys,m", [(32, 64, 1), (64, 512, 1), (64, 512, 16), (128, 1024, 4),
                                                 (64, 128, 8)])
def test_triton_launchers_size_by_the_plan(tile_n, split_keys, m):
    """Decode: the grid's split axis (`kernel_launches`) and the workspace; verification: its
    grid count and workspace, for a range of widths."""
    config = triton_decode.KernelConfig(tile_n=tile_n, split_keys=split_keys, min_splits=m)
    for block in (16, 32, 64):
        tile, split = split_units(block, tile_n, split_keys)
        assert triton_decode.split_rule(config, block) == dict(tile=tile, split=split, min_splits=m)
        for max_blocks in (1, 2, 3, 5, 8, 33, 100, 257):
            assert triton_decode._max_splits(config, block, max_blocks) == \
                max_splits(max_blocks, tile=tile, split=split, min_splits=m)
    block, max_blocks, heads, head_dim = 32, 9, 2, 16
    ws = triton_decode.DecodeWorkspace.allocate(1, heads, heads, head_dim, max_blocks, dtype=torch.float32,
                                                device="cpu", block_size=block, config=config)
    q = torch.zeros(1, heads, head_dim)
    pages = torch.zeros(4, 128, heads, head_dim)
    support = torch.zeros(1, heads, max_blocks, dtype=torch.bool)
    seq = torch.ones(1, dtype=torch.int32)
    (_, split_grid, *_), (_, _, _, finish_kw) = triton_decode.kernel_launches(
        q, pages, pages, torch.zeros(1, 4, dtype=torch.int32), seq, seq, support, ws.out[:1],
        ws.mass[:1], ws, scale=1.0, eta=0.9, return_mass=False)
    tile, split = split_units(block, tile_n, split_keys)
    want = max_splits(max_blocks, tile=tile, split=split, min_splits=m)
    assert split_grid == (heads, want) and ws.max_splits == want
    assert (finish_kw["TILE_BLOCKS"], finish_kw["SPLIT_BLOCKS"], finish_kw["MIN_SPLITS"]) == (tile, split, m)

    verify = triton_verify.KernelConfig(tile_n=tile_n, split_keys=split_keys, min_splits=m)
    for max_keys in (1, 17, 64, 300, 4096):
        want = max_splits(max_keys, tile=tile_n, split=split_keys, min_splits=m)
        assert triton_verify.max_splits(verify, max_keys) == want
        ws = triton_verify.VerifyWorkspace.allocate(1, 1, 1, 16, max_keys, dtype=torch.float32, device="cpu",
                                                    config=verify)
        assert ws.num_splits == want


def test_pallas_and_mosaic_size_by_the_plan():
    """pallas_decode's device rule (`_split_size`, `_splits`: plain jnp, as in its kernels) for
    widths 0..299; its grid (`KernelConfig.max_splits`) and the Mosaic launch's (its
    `split_rule`) for a range of widths."""
    n = jnp.asarray(WIDTHS)
    for tile, split, m in RULES:
        rule = dict(tile_blocks=tile, split_blocks=split, min_splits=m)
        size, count = pallas_decode._splits(n, **rule)
        assert np.array_equal(np.asarray(pallas_decode._split_size(n, **rule)), np.asarray(size))
        want_size, want_count = plan_sizes(tile, split, m)
        assert np.asarray(size).tolist() == want_size and np.asarray(count).tolist() == want_count
    for (tile_n, split_keys), m, block in itertools.product([(64, 512), (64, 1024), (128, 1024), (32, 64)],
                                                           [1, 3, 16], [16, 32]):
        tile, split = split_units(block, tile_n, split_keys)
        configs = [pallas_decode.KernelConfig(tile_n=tile_n, split_keys=split_keys, min_splits=m)]
        if tile_n >= 64:
            configs.append(mosaic_decode.MosaicConfig(tile_n=tile_n, split_keys=split_keys,
                                                      min_splits=m).split_rule())
        for config in configs:
            assert (config.tile_blocks(block), config.split_blocks(block)) == (tile, split)
            for max_blocks in (1, 2, 3, 5, 8, 33, 100, 257):
                assert config.max_splits(block, max_blocks) == \
                    max_splits(max_blocks, tile=tile, split=split, min_splits=m)
