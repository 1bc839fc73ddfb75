"""Fused Triton kernels of the decode path: RMSNorm, residual + RMSNorm, RoPE + K/V store, SiLU * up.

The torch-level API, with its checks and numerics, is `wise_torch.layers`; the launchers here
take checked inputs and preallocated outputs, allocate nothing and never read device memory on
the host, so they can be captured in a CUDA graph. Each call is one launch:

- `rms_norm`, `add_rms_norm`: one program per token row holds the whole row (hidden padded to
  a power of two) in registers, so a row's result never depends on the other rows of the batch.
- `rope_store_kv`: one program per token rotates its q and k heads, stores k and v at the
  token's cache slot and writes the rotated q.
- `silu_mul`: one program per (token, tile of `SILU_BLOCK` columns).

Every value is computed as torch's eager kernels compute it: inputs widened to float32, one
float32 rounding per operation (fp contraction off: no fused multiply-adds), a rounding to the
storage dtype wherever torch stores a tensor. SiLU uses libdevice's `expf` and IEEE division,
as torch's CUDA kernel does. Triton's interpreter (TRITON_INTERPRET=1, CPU tests) lacks two of
these: its float32 -> bfloat16 cast truncates and it has no libdevice; there `_round` rounds to
nearest even with integer ops and `_exp` takes numpy's exp.
"""

from __future__ import annotations

import os
import typing

import triton
import triton.language as tl
from triton.language.extra import libdevice

_knobs = getattr(triton, "knobs", None)
INTERPRET = bool(_knobs.runtime.interpret) if _knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"

SILU_BLOCK = 1024


class Launch(typing.NamedTuple):
    """One kernel launch: `kernel[grid](*args, **kwargs)` (also compiled offline by the tests)."""

    kernel: typing.Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict

    def __call__(self) -> None:
        if all(self.grid):
            self.kernel[self.grid](*self.args, **self.kwargs)


if INTERPRET:
    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """float32 x -> dtype, round to nearest even (NaN -> the quiet NaN torch writes)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(x != x, 0x7FC0, rounded)
            return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _exp(x):
        return tl.exp(x)
else:
    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """float32 x -> dtype, round to nearest even."""
        return x.to(dtype)

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)


def _options(num_warps: int) -> dict:
    return dict(num_warps=num_warps, num_stages=1, enable_fp_fusion=False)


def _row_warps(block: int) -> int:
    """Warps of a one-row program over `block` elements: about 16 elements per thread."""
    return min(16, max(1, block // 512))


# -- RMSNorm ------------------------------------------------------------------------------------
@triton.jit
def _rms(x, w, inv_hidden, eps, dtype: tl.constexpr):
    """HF RMSNorm of one row. x: float32 [BLOCK] (dtype values, 0 past hidden), w: [BLOCK] ->
    float32 [BLOCK] holding dtype values: w * (x * rsqrt(mean(x^2) + eps)).to(dtype)."""
    mean_square = tl.sum(x * x, 0) * inv_hidden
    normed = _round(x * tl.math.rsqrt(mean_square + eps), dtype).to(tl.float32)
    return _round(normed * w.to(tl.float32), dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, hidden, inv_hidden, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    dtype = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(y_ptr + row * stride_y + offs, _round(_rms(x, w, inv_hidden, eps, dtype), dtype), mask=ok)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, post_w_ptr, final_w_ptr, next_w_ptr, res_out_ptr, normed_ptr,
                         stride_x, stride_res, stride_res_out, stride_normed, hidden, inv_hidden, eps,
                         HAS_FINAL: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    dtype = res_out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * stride_res + offs, mask=ok, other=0.0).to(tl.float32)
    post = _rms(x, tl.load(post_w_ptr + offs, mask=ok, other=0.0), inv_hidden, eps, dtype)
    h = _round(res + post, dtype).to(tl.float32)
    if HAS_FINAL:
        h = _rms(h, tl.load(final_w_ptr + offs, mask=ok, other=0.0), inv_hidden, eps, dtype)
    tl.store(res_out_ptr + row * stride_res_out + offs, _round(h, dtype), mask=ok)
    if HAS_NEXT:
        normed = _rms(h, tl.load(next_w_ptr + offs, mask=ok, other=0.0), inv_hidden, eps, dtype)
        tl.store(normed_ptr + row * stride_normed + offs, _round(normed, dtype), mask=ok)


def rms_norm_launch(x, weight, eps: float, out) -> Launch:
    """x, out: [n, hidden] (rows contiguous); weight: [hidden]."""
    n, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    return Launch(_rms_norm_kernel, (n,), (x, weight, out, x.stride(0), out.stride(0), hidden, 1.0 / hidden, eps),
                  dict(BLOCK=block, **_options(_row_warps(block))))


def add_rms_norm_launch(x, residual, post_weight, next_weight, final_weight, eps: float,
                        residual_out, normed) -> Launch:
    """x, residual, residual_out, normed (or None): [n, hidden]; weights: [hidden] or None."""
    n, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    has_final, has_next = final_weight is not None, next_weight is not None
    normed_arg = normed if has_next else residual_out  # unused without HAS_NEXT
    return Launch(
        _add_rms_norm_kernel, (n,),
        (x, residual, post_weight, final_weight if has_final else post_weight, next_weight if has_next else post_weight,
         residual_out, normed_arg, x.stride(0), residual.stride(0), residual_out.stride(0), normed_arg.stride(0),
         hidden, 1.0 / hidden, eps),
        dict(HAS_FINAL=has_final, HAS_NEXT=has_next, BLOCK=block, **_options(_row_warps(block))))


def rms_norm(x, weight, eps: float, out) -> None:
    rms_norm_launch(x, weight, eps, out)()


def add_rms_norm(x, residual, post_weight, next_weight, final_weight, eps: float, residual_out, normed) -> None:
    add_rms_norm_launch(x, residual, post_weight, next_weight, final_weight, eps, residual_out, normed)()


# -- RoPE + K/V store -----------------------------------------------------------------------------
@triton.jit
def _rotate(base, row_stride, n_heads, c, s, HALF: tl.constexpr, HALF_PAD: tl.constexpr, H_PAD: tl.constexpr):
    """Split-half RoPE of n_heads heads at `base` (head h at base + h * row_stride), float32 math
    as `x * cos + rotate_half(x) * sin`. c, s: float32 [HALF_PAD] -> two halves float32 [H_PAD, HALF_PAD]."""
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    ok = (h < n_heads) & (d < HALF)
    x1 = tl.load(base + h * row_stride + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + h * row_stride + HALF + d, mask=ok, other=0.0).to(tl.float32)
    return x1 * c[None, :] + (-x2) * s[None, :], x2 * c[None, :] + x1 * s[None, :]


@triton.jit
def _rope_store_kv_kernel(qkv_ptr, pos_ptr, cos_sin_ptr, k_ptr, v_ptr, slot_ptr, q_ptr,
                          stride_qkv, stride_cs, max_positions, num_slots, page_size,
                          stride_page, stride_offset, stride_head,
                          HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HALF_PAD: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    pos_ok = (pos >= 0) & (pos < max_positions)
    slot_ok = (slot >= 0) & (slot < num_slots)
    d = tl.arange(0, HALF_PAD)
    # A position outside the table reads NaN cos/sin: its q and k come out NaN. (Masks combine a
    # scalar condition through tl.where: the interpreter mistypes scalar & tensor.)
    cs_ok = tl.where(pos_ok, d < HALF, False)
    c = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=cs_ok, other=float("nan"))
    s = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=cs_ok, other=float("nan"))
    dtype = qkv_ptr.dtype.element_ty
    kv_dtype = k_ptr.dtype.element_ty
    row = qkv_ptr + t * stride_qkv

    # q: [n, HEADS, HEAD_DIM]; a token whose slot is outside the planes stores nothing and gets a NaN q.
    q1, q2 = _rotate(row, HEAD_DIM, HEADS, c, s, HALF, HALF_PAD, HQ_PAD)
    hq = tl.arange(0, HQ_PAD)[:, None]
    q_ok = (hq < HEADS) & (d[None, :] < HALF)
    q_out = q_ptr + t * (HEADS * HEAD_DIM) + hq * HEAD_DIM + d[None, :]
    tl.store(q_out, _round(tl.where(slot_ok, q1, float("nan")), dtype), mask=q_ok)
    tl.store(q_out + HALF, _round(tl.where(slot_ok, q2, float("nan")), dtype), mask=q_ok)

    # k (rotated, rounded to qkv's dtype as torch stores it, then to the plane's) and v at the slot.
    k1, k2 = _rotate(row + HEADS * HEAD_DIM, HEAD_DIM, KV_HEADS, c, s, HALF, HALF_PAD, HK_PAD)
    hk = tl.arange(0, HK_PAD)[:, None]
    kv_ok = tl.where(slot_ok, (hk < KV_HEADS) & (d[None, :] < HALF), False)
    dst = (slot // page_size) * stride_page + (slot % page_size) * stride_offset + hk * stride_head + d[None, :]
    tl.store(k_ptr + dst, _round(_round(k1, dtype).to(tl.float32), kv_dtype), mask=kv_ok)
    tl.store(k_ptr + dst + HALF, _round(_round(k2, dtype).to(tl.float32), kv_dtype), mask=kv_ok)
    v_src = row + (HEADS + KV_HEADS) * HEAD_DIM + hk * HEAD_DIM + d[None, :]
    v1 = tl.load(v_src, mask=kv_ok, other=0.0).to(tl.float32)
    v2 = tl.load(v_src + HALF, mask=kv_ok, other=0.0).to(tl.float32)
    tl.store(v_ptr + dst, _round(v1, kv_dtype), mask=kv_ok)
    tl.store(v_ptr + dst + HALF, _round(v2, kv_dtype), mask=kv_ok)


def rope_store_kv_launch(qkv, positions, cos_sin, k_plane, v_plane, slot_mapping, q_out, *,
                         heads: int, kv_heads: int, head_dim: int) -> Launch:
    """qkv: [n, (heads + 2 kv_heads) head_dim] (rows contiguous); positions, slot_mapping: int64[n];
    cos_sin: float32[max_positions, head_dim]; k_plane, v_plane: [num_pages, page_size, kv_heads,
    head_dim], same strides, head_dim contiguous; q_out: [n, heads, head_dim] contiguous."""
    n = qkv.shape[0]
    num_pages, page_size = k_plane.shape[:2]
    half_pad = triton.next_power_of_2(head_dim // 2)
    hq_pad, hk_pad = triton.next_power_of_2(heads), triton.next_power_of_2(kv_heads)
    return Launch(
        _rope_store_kv_kernel, (n,),
        (qkv, positions, cos_sin, k_plane, v_plane, slot_mapping, q_out, qkv.stride(0), cos_sin.stride(0),
         cos_sin.shape[0], num_pages * page_size, page_size, k_plane.stride(0), k_plane.stride(1), k_plane.stride(2)),
        dict(HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF_PAD=half_pad, HQ_PAD=hq_pad, HK_PAD=hk_pad,
             **_options(4 if hq_pad * half_pad >= 1024 else 2)))


def rope_store_kv(qkv, positions, cos_sin, k_plane, v_plane, slot_mapping, q_out, *,
                  heads: int, kv_heads: int, head_dim: int) -> None:
    rope_store_kv_launch(qkv, positions, cos_sin, k_plane, v_plane, slot_mapping, q_out,
                         heads=heads, kv_heads=kv_heads, head_dim=head_dim)()


# -- SiLU * up ------------------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, stride_gu, stride_y, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    dtype = y_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=ok, other=0.0).to(tl.float32)
    silu = _round(tl.math.div_rn(gate, 1.0 + _exp(-gate)), dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, _round(silu * up, dtype), mask=ok)


def silu_mul_launch(gate_up, out) -> Launch:
    """gate_up: [n, 2 inter] (rows contiguous), out: [n, inter]."""
    n, inter = out.shape
    return Launch(_silu_mul_kernel, (n, triton.cdiv(inter, SILU_BLOCK)),
                  (gate_up, out, gate_up.stride(0), out.stride(0), inter), dict(BLOCK=SILU_BLOCK, **_options(4)))


def silu_mul(gate_up, out) -> None:
    silu_mul_launch(gate_up, out)()
