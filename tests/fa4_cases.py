"""A stand-in `flash_attn.cute` for CPU tests: FlashAttention-4 itself runs only in the `gpu`
tests, on an H200."""

import types

import torch

from wise_torch.attention import prefill_attention_varlen_reference
from wise_torch.kv_cache import VarlenPrefill
from wise_torch.union_decode import paged_decode_reference


def stand_in_fa4(calls):
    """A `flash_attn.cute` whose flash_attn_varlen_func checks FA4's argument contract for a
    paged varlen call and answers with the reference (FlashAttention's bottom-right causal)."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, seqused_q=None, seqused_k=None, page_table=None,
                               softmax_scale=None, causal=False, return_lse=False, **rest):
        assert not rest and cu_seqlens_k is None and seqused_q is None
        if cu_seqlens_q is None:      # batched decode: q [batch, 1, heads, head_dim], its last position
            assert q.dim() == 4 and q.shape[1] == 1 and max_seqlen_q is None
            batch = q.shape[0]
            cu = torch.arange(batch + 1, dtype=torch.int32)
            out, _ = flash_attn_varlen_func(q[:, 0], k, v, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=seqused_k,
                                            page_table=page_table, softmax_scale=softmax_scale, causal=True)
            calls[-1] = ("decode", calls[-1])
            if not return_lse:
                return out[:, None], None
            _, lse = paged_decode_reference(q[:, 0], k, v, page_table, seqused_k, scale=softmax_scale)
            return out[:, None], lse[..., None]             # FA4's [batch, heads, seqlen_q]
        assert causal is True and q.dim() == 3
        batch = cu_seqlens_q.shape[0] - 1
        total, heads, head_dim = q.shape
        num_pages, page_size, kv_heads, _ = k.shape
        assert v.shape == k.shape and heads % kv_heads == 0 and q.dtype == k.dtype == v.dtype
        for t, shape in ((cu_seqlens_q, (batch + 1,)), (seqused_k, (batch,))):
            assert t.dtype == torch.int32 and t.shape == shape and t.is_contiguous()
        assert page_table.dtype == torch.int32 and page_table.shape[0] == batch and page_table.stride(-1) == 1
        assert int(cu_seqlens_q[-1]) == total and isinstance(max_seqlen_q, int)
        assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        assert int(page_table.max()) < num_pages and bool((seqused_k <= page_table.shape[1] * page_size).all())
        calls.append(k.data_ptr())
        meta = VarlenPrefill(cu_seqlens_q, seqused_k, page_table, max_seqlen_q)
        return prefill_attention_varlen_reference(q, k, v, meta, scale=softmax_scale), None

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module
