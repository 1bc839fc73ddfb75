"""The split plan of the split-KV attention kernels: how a row's keys are cut into programs.

Every split-KV kernel (`wise_torch.kernels.triton_decode`, `wise_torch.kernels.triton_verify`,
`wise_jax.kernels.pallas_decode`, `wise_jax.kernels.mosaic_decode`) computes this rule on the
device from the row's length alone; its launcher sizes the grid by `max_splits`. This module is
the reference both are tested against (docs/DESIGN.md, "Split plan").

Units. A row is `n` units in list order: a decode row's listed WISE blocks, a verification
row's keys (a unit of one key). A tile is `tile` units (one loop step), a split at most `split`
units (one program); `tile` divides `split`.

Rule. count = max(ceil(n / split), min_splits) splits are wanted; each but the last has
size = ceil(ceil(n / count) / tile) tiles, within [1 tile, split]; split s covers units
[s * size, min((s + 1) * size, n)); splits past the row do nothing (one split at least, even
for an empty row).
"""

from __future__ import annotations

import numpy as np


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_rule(tile: int, split: int, min_splits: int) -> None:
    for name, value in (("tile", tile), ("split", split), ("min_splits", min_splits)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"split plan: {name} must be a positive integer, got {value!r}")
    if split % tile:
        raise ValueError(f"split plan: split ({split}) must be a whole number of tiles ({tile})")


def _check_width(name: str, n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"split plan: {name} must be a non-negative integer, got {n!r}")


def split_units(block_size: int, tile_n: int, split_keys: int) -> tuple[int, int]:
    """(tile, split) in blocks of block_size keys of a launch's tile_n and split_keys (keys a
    loop step, keys a program), each rounded up to a whole block (a tile), so that no block
    straddles two tiles or two splits. block_size=1: in keys."""
    for name, value in (("block_size", block_size), ("tile_n", tile_n), ("split_keys", split_keys)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
            raise ValueError(f"split plan: {name} must be a positive power of two, got {value!r}")
    return max(tile_n, block_size) // block_size, max(split_keys, tile_n, block_size) // block_size


def split_size(n: int, *, tile: int, split: int, min_splits: int = 1) -> int:
    """Units of each split but the last of a row of n units (the module docstring's rule)."""
    _check_rule(tile, split, min_splits)
    _check_width("n", n)
    count = max(_cdiv(n, split), min_splits)
    return min(max(_cdiv(_cdiv(n, count), tile) * tile, tile), split)


def split_count(n: int, *, tile: int, split: int, min_splits: int = 1) -> int:
    """Splits of a row of n units that hold units (1 for an empty row)."""
    return max(_cdiv(n, split_size(n, tile=tile, split=split, min_splits=min_splits)), 1)


def max_splits(max_n: int, *, tile: int, split: int, min_splits: int = 1) -> int:
    """The most splits of any row of at most max_n units: the grid's split axis. Exact (a row
    of max_n units, or of min_splits tiles, has that many)."""
    _check_rule(tile, split, min_splits)
    _check_width("max_n", max_n)
    return max(_cdiv(max_n, split), min(min_splits, _cdiv(max_n, tile)), 1)


def split_plan(n_keys: int, *, tile_n: int, split_keys: int, min_splits: int = 1,
               block_size: int = 1) -> np.ndarray:
    """Key ranges int64[count, 2] ([lo, hi) per split, in list order) of a row of n_keys keys
    in blocks of block_size (only its last block partial), for a launch of tile_n keys a step
    and split_keys keys a program (`split_units`); count = len(result) (`split_count`)."""
    tile, split = split_units(block_size, tile_n, split_keys)
    _check_width("n_keys", n_keys)
    n = _cdiv(n_keys, block_size)
    size = split_size(n, tile=tile, split=split, min_splits=min_splits)
    lo = np.arange(split_count(n, tile=tile, split=split, min_splits=min_splits), dtype=np.int64) * size
    return np.stack([lo * block_size, np.minimum((lo + size) * block_size, n_keys)], axis=1)
