"""The head dims the Triton attention kernels take (`triton_decode`, `triton_verify`,
`triton_block_mass`): any multiple of 16, e.g. huginn-0125's 96.

A Triton tensor's dims are powers of two, so tiles along head_dim are `block_d(head_dim)` (the
next power of two) wide; lanes d >= head_dim load 0, so they add nothing to q.k nor to p.v,
and store nothing. A power-of-two head_dim has no padded lane: `lanes` and `store_lanes` then
give the unmasked code (its loads and stores are those of a kernel without padding). Multiples
of 16 keep each K/V row 16-byte aligned and the lane mask constant over 16 lanes, so the
loads stay vectorised.
"""

from __future__ import annotations

import triton
import triton.language as tl


def takes(head_dim: int) -> bool:
    """Whether the kernels take q/K/V of this head_dim."""
    return head_dim >= 16 and head_dim % 16 == 0


def check(head_dim: int) -> None:
    """ValueError unless `takes(head_dim)`."""
    if not takes(head_dim):
        raise ValueError(f"head_dim must be a multiple of 16 (>= 16) for the Triton kernels, got {head_dim}")


def block_d(head_dim: int) -> int:
    """The tiles' width along head_dim: the next power of two."""
    return triton.next_power_of_2(head_dim)


@triton.jit
def lanes(ok, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The mask of a load or store over [.., BLOCK_D] lanes offs_d: `ok` (broadcast against
    them) and, for a padded head_dim (BLOCK_D > HEAD_DIM), d < HEAD_DIM; `ok` itself otherwise."""
    if BLOCK_D == HEAD_DIM:
        return ok
    else:
        return ok & (offs_d < HEAD_DIM)


@triton.jit
def store_lanes(ptrs, x, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store x [BLOCK_D] to ptrs [BLOCK_D] (lanes offs_d), lanes d < HEAD_DIM (unmasked when not
    padded)."""
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, x)
    else:
        tl.store(ptrs, x, mask=offs_d < HEAD_DIM)
