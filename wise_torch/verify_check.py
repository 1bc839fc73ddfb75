"""The verification contract (`wise_torch.verification`'s docstring) checked at a call: what the
reference and the Triton kernel run at their public entry (its own module, so the kernel and the
dispatcher import it, not each other)."""

from __future__ import annotations

import torch


def check_verify_args(q, k_pages, v_pages, page_table, starts) -> None:
    """Raise ValueError naming the first shape/dtype inconsistency of a verify_attention call."""
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, n, heads, head_dim], got shape {tuple(q.shape)}")
    batch, _, heads, head_dim = q.shape
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [num_pages, page_size, kv_heads, head_dim], "
                         f"got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    kv_heads, kv_dim = k_pages.shape[2:]
    if kv_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the cache has {kv_dim}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be int32[batch={batch}, max_pages], got "
                         f"{page_table.dtype}{list(page_table.shape)}")
    if tuple(starts.shape) != (batch,) or starts.dtype != torch.int32:
        raise ValueError(f"starts must be int32[batch={batch}], got {starts.dtype}{list(starts.shape)}")
