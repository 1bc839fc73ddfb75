"""The split plan and the merge of splits on the device, shared by the Triton split-KV kernels
(`triton_decode`, `triton_verify`).

`splits` is `wise_core.split_plan`'s rule for one row (tests/wise_core/test_split_plan.py holds the two
equal); `merge_splits` combines a (row, head)'s split partials in split order; `check_launch` checks a
kernel's launch shape (each kernel's `KernelConfig`).
"""

from __future__ import annotations

import triton
import triton.language as tl


def check_launch(config) -> None:
    """A split kernel's launch shape (its KernelConfig): tile_n, split_keys and num_warps powers of
    two, 16 <= tile_n <= split_keys, num_stages and min_splits >= 1; else a ValueError naming them."""
    for name in ("tile_n", "split_keys", "num_warps"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"KernelConfig.{name} must be a power of two, got {value}")
    if config.tile_n < 16 or config.split_keys < config.tile_n:
        raise ValueError(f"KernelConfig needs 16 <= tile_n <= split_keys, got {config}")
    for name in ("num_stages", "min_splits"):
        if getattr(config, name) < 1:
            raise ValueError(f"KernelConfig.{name} must be >= 1, got {getattr(config, name)}")


@triton.jit
def splits(n, TILE: tl.constexpr, SPLIT: tl.constexpr, MIN_SPLITS: tl.constexpr):
    """(size, count) of a row of n units (`wise_core.split_plan.split_size`, `split_count`):
    units of each split but the last, splits that hold units (1 for an empty row)."""
    wanted = tl.maximum(tl.cdiv(n, SPLIT), MIN_SPLITS)
    size = tl.minimum(tl.maximum(tl.cdiv(tl.cdiv(n, wanted), TILE) * TILE, TILE), SPLIT)
    return size, tl.maximum(tl.cdiv(n, size), 1)


@triton.jit
def merge_splits(part_acc_ptr, part_m_ptr, part_l_ptr, part, n_splits,
                 BLOCK_D: tl.constexpr, S_CHUNK: tl.constexpr):
    """Splits [0, n_splits) of one (row, head), partials at `part` + split: acc float32
    [.., BLOCK_D] (unnormalised output, head_dim padded to a power of two: `triton_head_dim`),
    m (max score, base 2), l (sum of exponentials), merged in split order, S_CHUNK at a time ->
    (acc [BLOCK_D], m [1], l [1]); the output is acc / l. A split without keys (0, -inf, 0)
    adds nothing."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, S_CHUNK)
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for c in range(0, n_splits, S_CHUNK):
        split_ok = c + offs_s < n_splits
        m_s = tl.load(part_m_ptr + part + c + offs_s, mask=split_ok, other=float("-inf"))
        l_s = tl.load(part_l_ptr + part + c + offs_s, mask=split_ok, other=0.0)
        acc_s = tl.load(part_acc_ptr + (part + c + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                        mask=split_ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, 0, keep_dims=True))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(m_s - m_ref)
        l_run = l_run * alpha + tl.sum(l_s * w, 0, keep_dims=True)
        acc = acc * alpha + tl.sum(acc_s * w[:, None], 0)
        m_run = m_new
    return acc, m_run, l_run
