"""The reference system's FlashAttention WISE decode, as an arm beside the decode kernel
(`LLM(wise_decode="fa4-union")`; `"reference-union"` is the same in plain torch, for a CPU).

It is not the decode contract (docs/DESIGN.md): a SPARSE row attends the union over heads of
its support, widened to whole pages, so every head reads every page that any head selected.
One paged attention call runs every row over a page table compacted per row
(`union_page_table`: the row's pages holding a selected block, in order, then padding the call
never reads; a row that does not reuse keeps its table). With every block selected the
compacted table is the table: the call is bitwise the dense one. Discovery rows attend densely;
their block mass is rebuilt from the call's log-sum-exp with one more read of K
(`block_mass_from_lse`: exp(scale * q.k - lse) summed per block, the softmax's block sums; on a
GPU the Triton kernel `wise_torch.kernels.triton_block_mass`), and the selection rule runs on
it as in the kernels.

A paged attention (`paged_decode`'s signature: out [batch, heads, head_dim] and natural-log
lse float32[batch, heads]) is FlashAttention-4's paged decode (`wise_torch.kernels.fa4`) on a
GPU, or `paged_decode_reference`. Every step is static in shape (no host sync): the arm runs
inside the engine's CUDA graphs.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from wise_core import selection as rules
from wise_core.kv_quant import check_kv_cache_dtype
from wise_core.modes import SPARSE
from wise_torch.attention import require_fa4, select_after, select_blocks, update_support
from wise_torch.decode_check import check_call

WISE_DECODE = ("kernel", "fa4-union", "reference-union")


def paged_decode_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                           seq_lens: torch.Tensor, *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over its first seq_lens[b] paged keys: q [batch, heads, head_dim];
    k_pages, v_pages [num_pages, page_size, kv_heads, head_dim]; page_table int32[batch, width];
    seq_lens int32[batch] -> (out [batch, heads, head_dim] in q's dtype, lse float32[batch,
    heads]). float32 math; a row with no key gives NaN. A value past seq_lens[b] reads as 0: a
    page's slots past the row's keys hold their last holder's values, and 0 x NaN there would
    make the row NaN."""
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    keys = page_table.shape[1] * page_size
    scores = paged_scores(q, k_pages, page_table, seq_lens, scale)
    v = v_pages[page_table.long()].reshape(batch, keys, kv_heads, head_dim).float()
    v = v.masked_fill(~held_keys(seq_lens, keys)[:, :, None, None], 0.0)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bkgs,bskd->bkgd", probs.reshape(batch, kv_heads, heads // kv_heads, keys), v)
    return out.reshape(batch, heads, head_dim).to(q.dtype), lse


def union_page_table(page_table: torch.Tensor, seq_lens: torch.Tensor, modes: torch.Tensor, support: torch.Tensor,
                     *, page_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The compacted call of a step: page_table int32[batch, width]; seq_lens int32[batch];
    modes int32[batch]; support bool[batch, heads, >= width * page_size / block_size] ->
    (table int32[batch, width], lens int32[batch]). A SPARSE row keeps, in order, the causal
    pages holding a block that any head selected (its last page counts its seq_lens keys, the
    others page_size), then its other pages (never read); other rows are unchanged."""
    batch, width = page_table.shape
    per_page = page_size // block_size
    lens = seq_lens.long()
    pages = (lens + page_size - 1) // page_size                                         # [batch]
    causal = torch.arange(width, device=page_table.device)[None, :] < pages[:, None]  # [batch, width]
    chosen = support[..., :width * per_page].any(1).view(batch, width, per_page).any(-1)
    keep = causal & (chosen | (modes != SPARSE)[:, None])
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)   # kept pages first, in order
    last = (pages - 1).clamp(min=0)[:, None]
    tail = torch.where(keep.gather(1, last)[:, 0], pages * page_size - lens, 0)  # unfilled slots of the last page
    return page_table.gather(1, order), (keep.sum(1) * page_size - tail).to(torch.int32)


def block_mass_from_lse(q: torch.Tensor, k_pages: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                        lse: torch.Tensor, *, block_size: int, scale: float | None = None) -> torch.Tensor:
    """The block mass of a dense call's probabilities, from its log-sum-exp: one read of K.
    q [batch, heads, head_dim]; k_pages [num_pages, page_size, kv_heads, head_dim]; page_table
    int32[batch, width]; seq_lens int32[batch]; lse float32[batch, heads] -> float32[batch,
    heads, width * page_size / block_size] (blocks past seq_lens: 0)."""
    batch, heads, _ = q.shape
    probs = torch.exp(paged_scores(q, k_pages, page_table, seq_lens, scale) - lse[..., None])   # 0 past seq_lens
    return probs.view(batch, heads, -1, block_size).sum(-1)


def paged_scores(q: torch.Tensor, k_pages: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float | None) -> torch.Tensor:
    """scale * q.k of each row's paged keys, float32[batch, heads, width * page_size], -inf past
    seq_lens (the shapes of `paged_decode_reference`)."""
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    keys = page_table.shape[1] * page_size
    scale = head_dim ** -0.5 if scale is None else scale
    k = k_pages[page_table.long()].reshape(batch, keys, kv_heads, head_dim).float()
    qg = q.float().reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k).reshape(batch, heads, keys) * scale
    return scores.masked_fill(~held_keys(seq_lens, keys)[:, None, :], float("-inf"))


def held_keys(seq_lens: torch.Tensor, keys: int) -> torch.Tensor:
    """bool[batch, keys]: key j of row b is one of its seq_lens[b] keys."""
    return torch.arange(keys, device=seq_lens.device)[None, :] < seq_lens.long()[:, None]


def decode_attention_union(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size: int,
                           eta: float, paged_decode: Callable, block_mass: Callable = block_mass_from_lse,
                           scale: float | None = None, return_mass: bool = False, validate: bool = True,
                           reuse: bool = False):
    """`decode_attention_reference`'s signature, the union semantics of the module docstring:
    (out, support) and with return_mass the block mass of the dense probabilities of each row
    that is not SPARSE (zeros for SPARSE rows, and for every row of a reuse call).
    paged_decode: the paged attention (`paged_decode_reference`'s signature); block_mass:
    `block_mass_from_lse`'s (or the Triton kernel's). reuse: no row discovers (a reuse loop's
    call): K is not read again."""
    check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size, eta=eta,
               validate=validate, reuse=reuse)
    table, lens = union_page_table(page_table, seq_lens, modes, support, page_size=k_pages.shape[1],
                                   block_size=block_size)
    out, lse = paged_decode(q, k_pages, v_pages, table, lens, scale=scale)
    if reuse:
        mass = torch.zeros(support.shape, dtype=torch.float32, device=q.device) if return_mass else None
    else:
        mass = torch.zeros(support.shape, dtype=torch.float32, device=q.device)
        dense = block_mass(q, k_pages, page_table, seq_lens, lse, block_size=block_size, scale=scale)
        mass[..., :dense.shape[-1]] = dense
        mass = torch.where((modes == SPARSE)[:, None, None], 0.0, mass)
        support.copy_(update_support(modes, support, select_blocks(mass, eta)))
    return (out, support, mass) if return_mass else (out, support)


def resolve_wise_decode(name: str, device: torch.device | str, dtype: torch.dtype,
                        selection: rules.SelectionRule | None = None, kv_cache_dtype: str = "auto") -> Callable | None:
    """What runs the WISE loops: "kernel" -> None (the WiseConfig's decode kernel, the
    contract); "fa4-union" -> `decode_attention_union` over FlashAttention-4's paged decode, the
    block mass by the Triton kernel (`wise_torch.kernels.triton_block_mass`; an error naming
    what is missing where FA4 cannot run); "reference-union" -> over `paged_decode_reference`
    and `block_mass_from_lse`. Validation off (the engine builds the inputs); a selection rule
    other than eta runs on the rebuilt mass. kv_cache_dtype "fp8": the union arms do not read
    fp8 pages yet (a ValueError naming wise_decode); "kernel" runs."""
    if name not in WISE_DECODE:
        raise ValueError(f"wise_decode {name!r} is not available in wise_torch (choose from {WISE_DECODE})")
    if name == "kernel":
        return None
    if check_kv_cache_dtype(kv_cache_dtype) != "auto":
        raise ValueError(f"wise_decode={name!r} (the union arm) does not read kv_cache_dtype={kv_cache_dtype!r} "
                         f"pages yet: use wise_decode='kernel'")
    if name == "fa4-union":
        require_fa4("wise_decode", device, dtype)
        from wise_torch.kernels import fa4, triton_block_mass
        paged = functools.partial(fa4.decode_attention_dense, return_lse=True)
        mass = triton_block_mass.block_mass_from_lse
    else:
        paged, mass = paged_decode_reference, block_mass_from_lse
    fn = functools.partial(decode_attention_union, paged_decode=paged, block_mass=mass, validate=False)
    return fn if selection is None or isinstance(selection, rules.Eta) else select_after(fn, selection)
