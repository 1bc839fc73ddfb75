"""Block mass from a dense call's log-sum-exp, in Triton: the discovery step of
`wise_torch.union_decode` (`block_mass_from_lse`'s contract) as one read of K.

Program (row, kv_head, block) of the grid [batch, kv_heads, blocks]: it loads the block's keys
through the page table and the group's query heads, and sums exp(scale * q.k - lse) over the
block's causal keys (float32, base 2). Blocks past seq_lens store 0. head_dim: any multiple of
16, padded to a power of two (`triton_head_dim`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from wise_torch.kernels import triton_head_dim
from wise_torch.kernels.triton_head_dim import lanes


@triton.jit
def _block_mass_kernel(q_ptr, k_ptr, table_ptr, lens_ptr, lse_ptr, mass_ptr,
                       stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_tb, stride_lb,
                       stride_mb, stride_mh, qk_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                       GROUP_PAD: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr):
    row, kvh, blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(lens_ptr + row)
    keys = blk * BLOCK + tl.arange(0, BLOCK)
    causal = keys < seq_len
    page = tl.load(table_ptr + row * stride_tb + keys // PAGE, mask=causal, other=0)
    d = tl.arange(0, BLOCK_D)  # head_dim's lanes, padded to a power of two (triton_head_dim)
    k = tl.load(k_ptr + page[:, None] * stride_kp + (keys % PAGE)[:, None] * stride_kt + kvh * stride_kh
                + d[None, :], mask=lanes(causal[:, None], d[None, :], HEAD_DIM, BLOCK_D),
                other=0.0).to(tl.float32)                                                      # [BLOCK, BLOCK_D]
    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    in_group = g < GROUP
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=lanes(in_group[:, None], d[None, :], HEAD_DIM, BLOCK_D),
                other=0.0).to(tl.float32)                                                      # [GROUP_PAD, BLOCK_D]
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * qk_scale                         # base 2
    lse = tl.load(lse_ptr + row * stride_lb + heads, mask=in_group, other=0.0) * 1.4426950408889634
    p = tl.where(causal[None, :], tl.exp2(scores - lse[:, None]), 0.0)
    tl.store(mass_ptr + row * stride_mb + heads * stride_mh + blk, tl.sum(p, axis=1), mask=in_group)


def block_mass_from_lse(q: torch.Tensor, k_pages: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                        lse: torch.Tensor, *, block_size: int, scale: float | None = None) -> torch.Tensor:
    """`wise_torch.union_decode.block_mass_from_lse` in one launch: q [batch, heads, head_dim];
    k_pages [num_pages, page_size, kv_heads, head_dim] (head_dim contiguous); page_table
    int32[batch, width]; seq_lens int32[batch]; lse float32[batch, heads] -> float32[batch, heads,
    width * page_size / block_size]. head_dim a multiple of 16, block_size a power of two."""
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    triton_head_dim.check(head_dim)
    if block_size & (block_size - 1) or page_size % block_size:
        raise ValueError(f"block_size ({block_size}) must be a power of two and page_size ({page_size}) a "
                         f"multiple of it")
    if tuple(lse.shape) != (batch, heads):
        raise ValueError(f"lse must be [{batch}, {heads}] (a row's log-sum-exp per query head), got {list(lse.shape)}")
    if k_pages.stride(3) != 1 or q.stride(2) != 1 or lse.stride(1) != 1 or page_table.stride(1) != 1:
        raise ValueError("q and k_pages must be contiguous in head_dim, lse in heads, page_table in pages")
    blocks = page_table.shape[1] * page_size // block_size
    mass = torch.empty(batch, heads, blocks, dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    if batch and blocks:
        _block_mass_kernel[(batch, kv_heads, blocks)](
            q, k_pages, page_table, seq_lens, lse, mass,
            q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), page_table.stride(0),
            lse.stride(0), mass.stride(0), mass.stride(1), scale * math.log2(math.e),
            HEAD_DIM=head_dim, BLOCK_D=triton_head_dim.block_d(head_dim), GROUP=group,
            GROUP_PAD=triton.next_power_of_2(group), BLOCK=block_size, PAGE=page_size)
    return mass
