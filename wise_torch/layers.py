"""Token-major building blocks of the decoder: RMSNorm junctions, RoPE + K/V store, SwiGLU.

Plain-torch versions (the semantics of wise_torch.model's HF-style modules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rope_table(max_positions: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """float32[max_positions, head_dim]: cos of the head_dim/2 frequencies, then their sin."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [n, hidden] -> weight * (x * rsqrt(mean(x^2) + eps)) (normalised in fp32, cast back)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x, residual, post_weight, next_weight, eps, final_weight=None):
    """residual + rms_norm(x, post_weight) [-> rms_norm(., final_weight)] and its rms_norm by
    next_weight (None when next_weight is None)."""
    out = residual + rms_norm(x, post_weight, eps)
    if final_weight is not None:
        out = rms_norm(out, final_weight, eps)
    return out, None if next_weight is None else rms_norm(out, next_weight, eps)


def rope_store_kv(qkv, positions, cos_sin, k_plane, v_plane, slot_mapping, *, heads, kv_heads, head_dim):
    """qkv: [n, (heads + 2 kv_heads) head_dim] -> roped q [n, heads, head_dim]; roped k and v are
    stored at the flat slots int64[n] of one cache plane [num_pages, page_size, kv_heads, head_dim]."""
    n = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    cs = cos_sin[positions]
    half = head_dim // 2
    cos, sin = torch.cat((cs[:, :half], cs[:, :half]), -1), torch.cat((cs[:, half:], cs[:, half:]), -1)

    def rope(x):
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]).to(x.dtype)

    k_plane.view(-1, kv_heads, head_dim).index_copy_(
        0, slot_mapping, rope(k.reshape(n, kv_heads, head_dim)).to(k_plane.dtype))
    v_plane.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.reshape(n, kv_heads, head_dim).to(v_plane.dtype))
    return rope(q.reshape(n, heads, head_dim))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [n, 2 inter] (gate | up) -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
