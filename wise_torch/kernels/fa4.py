"""FlashAttention-4 (pip package `flash-attn-4`, module `flash_attn.cute`) over the paged pool:
packed prefill (`prefill_attention_varlen`) and dense decode rows (`decode_attention_dense`, also
the paged call of `wise_torch.union_decode`).

`prefill_attention_varlen` is `wise_torch.attention.prefill_attention_varlen_reference`'s
contract in one `flash_attn_varlen_func` call: the step's chunks packed as varlen queries
(`cu_seqlens_q`, `max_seqlen_q`), keys read through the page table (`page_table` int32,
`seqused_k` int32 per request; no `cu_seqlens_k`: FA4 takes one or the other), `causal=True`
(FlashAttention aligns the causal mask to the bottom right, so a chunk of n queries over
seqused_k keys starts at position seqused_k - n: the chunk's cached prefix is its offset).
No K/V is copied and no mask is built. FA4 runs on sm90/sm100 in float16/bfloat16, head_dim
a multiple of 8 up to 256; page size 128 takes its TMA path. The first call per shape compiles
(seconds). flash_attn.cute is imported on first use; CI has no GPU, so CPU tests check the
arguments through a stand-in module, and the `gpu` tests run it on an H200.
"""

from __future__ import annotations

import importlib

import torch

from wise_torch.kv_cache import VarlenPrefill

PACKAGE = "flash-attn-4"
MODULE = "flash_attn.cute"


def import_error() -> str | None:
    """Why flash_attn.cute does not import here ("ExcType: message"), None when it does."""
    try:
        importlib.import_module(MODULE)
    except Exception as e:  # noqa: BLE001 -- a broken CUDA/cutlass install raises more than ImportError
        return f"{type(e).__name__}: {e}"
    return None


def prefill_attention_varlen(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                             varlen: VarlenPrefill, *, scale: float | None = None) -> torch.Tensor:
    """q: [total, heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]
    (one plane of the pool); varlen: the step's chunks -> [total, heads, head_dim] in q's dtype."""
    out, _ = importlib.import_module(MODULE).flash_attn_varlen_func(
        q, k_pages, v_pages, cu_seqlens_q=varlen.cu_seqlens_q, max_seqlen_q=varlen.max_seqlen_q,
        seqused_k=varlen.seqused_k, page_table=varlen.page_table, softmax_scale=scale, causal=True)
    return out


def decode_attention_dense(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                           seq_lens: torch.Tensor, *, scale: float | None = None, return_lse: bool = False):
    """One query per row over all its paged keys (a DENSE decode row of
    `wise_torch.attention.decode_attention_reference`): q [batch, heads, head_dim];
    page_table int32[batch, width]; seq_lens int32[batch] -> [batch, heads, head_dim], and with
    return_lse the natural-log log-sum-exp of the scaled scores float32[batch, heads].
    One FA4 call of q [batch, 1, heads, head_dim] with seqused_k; no split over keys (SplitKV is
    not supported on sm90, so few long rows leave SMs idle)."""
    out, lse = importlib.import_module(MODULE).flash_attn_varlen_func(
        q[:, None], k_pages, v_pages, seqused_k=seq_lens, page_table=page_table, softmax_scale=scale,
        return_lse=return_lse)
    return (out[:, 0], lse[..., 0]) if return_lse else out[:, 0]
