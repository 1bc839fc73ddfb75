"""Token-major layer functions of the Ouro decoder: RMSNorm, residual + RMSNorm, RoPE + K/V
store, SiLU * up.

Every function takes 2-D token-major inputs (`[n_tokens, ...]`, n_tokens may be 0) and runs the
fused Triton kernel of `wise_torch.kernels.fused` on CUDA tensors and plain torch otherwise;
`impl="torch"` or `impl="triton"` forces one (Triton on CPU tensors needs the interpreter,
TRITON_INTERPRET=1). The torch versions are the HF computations op for op. The Triton versions
are one launch each, allocate only their outputs, never read device memory on the host, and can
be captured in a CUDA graph; each docstring states how they relate to the torch version
numerically. "ulp": the spacing of the output dtype at the torch value's magnitude.

Shapes and dtypes are checked on the host (metadata only). Values are not read: an
out-of-range position or slot is a device-side error in the torch version and a NaN q (no store)
in the Triton version.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from wise_torch import kv_quant

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
IMPLS = ("auto", "torch", "triton")


# -- checks and dispatch ----------------------------------------------------------------------------
def _use_triton(impl: str, device: torch.device) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return device.type == "cuda"
    if impl == "triton" and device.type != "cuda":
        from wise_torch.kernels import fused
        if not fused.INTERPRET:
            raise ValueError(f"impl='triton' needs CUDA tensors, got {device} (on CPU only under Triton's "
                             "interpreter, TRITON_INTERPRET=1)")
    return impl == "triton"


def _check_rows(name: str, t, width: int | None = None, dtype: torch.dtype | None = None) -> None:
    """t: a [n, width] floating tensor (of `dtype`) with contiguous rows."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [n_tokens, features], got shape {tuple(t.shape)}")
    if t.dtype not in DTYPES or (dtype is not None and t.dtype != dtype):
        want = f"{dtype}" if dtype is not None else f"one of {DTYPES}"
        raise ValueError(f"{name} must be {want}, got {t.dtype}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name} must have {width} features per token, got shape {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along features, got strides {t.stride()}")


def _check_weight(name: str, w, x: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (x.shape[1],) or w.dtype != x.dtype:
        got = f"{w.dtype}{list(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name} must be {x.dtype}[{x.shape[1]}] (x's dtype and hidden size), got {got}")
    if not w.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    return float(eps)


def _check_device(**tensors) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    return next(iter(devices.values()))


# -- RMSNorm ----------------------------------------------------------------------------------------
def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: str = "auto") -> torch.Tensor:
    """HF RMSNorm: `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`, statistics in float32.

    x: [n, hidden]; weight: [hidden] in x's dtype -> y: [n, hidden] in x's dtype.

    Triton against torch: every elementwise step is torch's (float32 math, the same roundings to
    the dtype, the product with weight rounded once); the sum of squares is a tree reduction in
    another order and rsqrt may differ by its 2-ulp error. float32: |y - y_torch| <=
    (hidden + 16) * 2^-24 * |y_torch| (each order's sum of positive terms is within
    (hidden - 1) * 2^-24 of the exact one, the square root halves that; the rest is a few
    roundings). bfloat16 / float16 (hidden < 2^15 / 2^12): those float32 values round to the same
    dtype value or a neighbour, so |y - y_torch| <= 2 ulp; most elements are equal. A row's result
    does not depend on the other rows or their number (bitwise, for inputs of one row stride).
    """
    _check_rows("x", x)
    _check_weight("weight", weight, x)
    eps = _check_eps(eps)
    device = _check_device(x=x, weight=weight)
    if not _use_triton(impl, device):
        return _rms_norm_torch(x, weight, eps)
    from wise_torch.kernels import fused
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    fused.rms_norm(x, weight, eps, out)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
                 next_weight: torch.Tensor | None, eps: float, final_weight: torch.Tensor | None = None, *,
                 impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sandwich-norm junction of Ouro, in one launch:

        residual_out = residual + rms_norm(x, post_weight)            (rounded to the dtype, as torch adds)
        residual_out = rms_norm(residual_out, final_weight)           (if final_weight: `model.norm` at a loop's end)
        normed       = rms_norm(residual_out, next_weight)            (None when next_weight is None)

    x, residual: [n, hidden], one dtype; weights: [hidden] in that dtype -> (residual_out, normed),
    [n, hidden] each. E.g. `h, a = add_rms_norm(attn_out, h, input_layernorm_2.weight,
    post_attention_layernorm.weight, eps)`; after a loop's last layer `next_weight` is the next
    loop's first `input_layernorm` and `final_weight` is `model.norm`.

    Triton against torch, stage by stage (each rms_norm as in `rms_norm`'s docstring): the add
    is torch's, one rounding of the float32 sum of residual and the kernel's rms_norm(x,
    post_weight), so without final_weight |residual_out - residual_out_torch| <= that
    rms_norm's bound + 1 ulp; with final_weight residual_out is the kernel's rms_norm of that
    sum, and normed is the kernel's rms_norm of residual_out. Rows are independent.
    """
    _check_rows("x", x)
    _check_rows("residual", residual, x.shape[1], x.dtype)
    if residual.shape[0] != x.shape[0]:
        raise ValueError(f"x and residual must have the same tokens, got {tuple(x.shape)} and {tuple(residual.shape)}")
    for name, w in (("post_weight", post_weight), ("next_weight", next_weight), ("final_weight", final_weight)):
        if w is not None or name == "post_weight":
            _check_weight(name, w, x)
    eps = _check_eps(eps)
    device = _check_device(x=x, residual=residual, post_weight=post_weight, next_weight=next_weight,
                           final_weight=final_weight)
    if not _use_triton(impl, device):
        h = residual + _rms_norm_torch(x, post_weight, eps)
        if final_weight is not None:
            h = _rms_norm_torch(h, final_weight, eps)
        return h, None if next_weight is None else _rms_norm_torch(h, next_weight, eps)
    from wise_torch.kernels import fused
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=device)
    normed = None if next_weight is None else torch.empty(x.shape, dtype=x.dtype, device=device)
    fused.add_rms_norm(x, residual, post_weight, next_weight, final_weight, eps, residual_out, normed)
    return residual_out, normed


# -- RoPE + K/V store ---------------------------------------------------------------------------------
def rope_table(max_positions: int, head_dim: int, theta: float, *,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """float32[max_positions, head_dim]: per position the cos of the head_dim / 2 HF frequencies,
    then their sin. The fp32 math of `wise_torch.model.rope_cos_sin` (bitwise its values):
    `inv_freq = 1 / theta ** (arange(0, head_dim, 2) / head_dim)`, angle = position * inv_freq."""
    for name, value in (("max_positions", max_positions), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (split-half RoPE), got {head_dim}")
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
        raise ValueError(f"theta must be a positive finite number, got {theta!r}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, head_dim]; cos, sin: float32[n, head_dim] -> x rotated (fp32 math), x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def _rope_store_kv_torch(qkv, positions, cos_sin, k_plane, v_plane, slot_mapping, heads, kv_heads, head_dim,
                         k_scale=None, v_scale=None):
    n, page_size = qkv.shape[0], k_plane.shape[1]
    torch._assert_async(((positions >= 0) & (positions < cos_sin.shape[0])).all(),
                        "rope_store_kv: a position is outside the cos_sin table")
    torch._assert_async(((slot_mapping >= 0) & (slot_mapping < k_plane.shape[0] * page_size)).all(),
                        "rope_store_kv: a slot is outside the KV planes")
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    q = _apply_rope_torch(q.view(n, heads, head_dim), cos, sin)
    k = _apply_rope_torch(k.view(n, kv_heads, head_dim), cos, sin)
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    v = v.view(n, kv_heads, head_dim)
    if k_scale is None:
        k_plane[page, offset] = k.to(k_plane.dtype)
        v_plane[page, offset] = v.to(v_plane.dtype)
        return q
    for x, codes, scales in ((k, k_plane, k_scale), (v, v_plane, v_scale)):   # an fp8 plane: quantized
        codes[page, offset], scales[page, offset] = kv_quant.quantize(x)
    return q


def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_plane: torch.Tensor,
                  v_plane: torch.Tensor, slot_mapping: torch.Tensor, *, heads: int, kv_heads: int,
                  head_dim: int, impl: str = "auto", k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Split-half RoPE on q and k of a fused qkv projection; k and v stored in a paged plane.

    qkv: [n, (heads + 2 kv_heads) * head_dim] (q | k | v); positions: int64[n];
    cos_sin: float32[max_positions, head_dim] (`rope_table`); k_plane, v_plane: [num_pages,
    page_size, kv_heads, head_dim] (one (loop, layer) plane of the paged cache, same strides);
    slot_mapping: int64[n], flat slot page * page_size + offset of each token (distinct).
    Stores roped k and v at the slots (cast to the plane's dtype) and returns roped q:
    [n, heads, head_dim] in qkv's dtype.

    The rotation is `wise_torch.model.apply_rope`'s: `x * cos + rotate_half(x) * sin` in float32,
    rounded to qkv's dtype (k then cast to the plane's dtype, as the cache write does). Triton
    against torch: bitwise equal (q and the stored k, v), since both round each float32 product
    and sum once (no fused multiply-add) and take cos/sin from the same table.

    An out-of-range position or slot: torch raises (device-side assert on CUDA); Triton gives
    that token a NaN q (and a NaN k where the slot is valid) and stores nothing outside the planes.

    k_scale, v_scale: an fp8 plane's scales float32 [num_pages, page_size, kv_heads] (both or
    neither), k_plane and v_plane then its uint8 e4m3fn codes: the roped k (in qkv's dtype) and v
    are stored as `wise_torch.kv_quant.quantize` gives them, codes and one scale per (token, KV
    head). The torch version runs it on every device ("auto"; the fused Triton kernel does not
    quantize, so impl="triton" is a ValueError).
    """
    for name, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (split-half RoPE), got {head_dim}")
    _check_rows("qkv", qkv, (heads + 2 * kv_heads) * head_dim)
    n = qkv.shape[0]
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (n,) or not t.is_contiguous():
            got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a contiguous int64[{n}] (one per token), got {got}")
    if (not isinstance(cos_sin, torch.Tensor) or cos_sin.dtype != torch.float32 or cos_sin.dim() != 2
            or cos_sin.shape[1] != head_dim or cos_sin.stride(1) != 1):
        got = f"{cos_sin.dtype}{list(cos_sin.shape)}" if isinstance(cos_sin, torch.Tensor) else type(cos_sin).__name__
        raise ValueError(f"cos_sin must be float32[max_positions, {head_dim}] (rope_table), got {got}")
    quantized = _check_scales(k_scale, v_scale, k_plane)
    for name, t in (("k_plane", k_plane), ("v_plane", v_plane)):
        if (not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[2:]) != (kv_heads, head_dim)
                or (t.dtype != torch.uint8 if quantized else t.dtype not in DTYPES) or t.stride(3) != 1):
            got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            kind = "uint8 (fp8 codes, with k_scale and v_scale)" if quantized else "floating"
            raise ValueError(f"{name} must be a {kind} [num_pages, page_size, {kv_heads}, {head_dim}] plane "
                             f"contiguous in head_dim, got {got}")
    if k_plane.shape != v_plane.shape or k_plane.dtype != v_plane.dtype or k_plane.stride() != v_plane.stride():
        raise ValueError(f"k_plane and v_plane must share shape, dtype and strides, got "
                         f"{k_plane.dtype}{list(k_plane.shape)} {k_plane.stride()} and "
                         f"{v_plane.dtype}{list(v_plane.shape)} {v_plane.stride()}")
    device = _check_device(qkv=qkv, positions=positions, cos_sin=cos_sin, k_plane=k_plane, v_plane=v_plane,
                           slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)
    if quantized and impl == "triton":
        raise ValueError("impl='triton' (the fused kernel) does not quantize K/V: an fp8 plane (k_scale, v_scale) "
                         "is stored by the torch version (impl='auto' or 'torch')")
    if quantized or not _use_triton(impl, device):
        return _rope_store_kv_torch(qkv, positions, cos_sin, k_plane, v_plane, slot_mapping, heads, kv_heads,
                                    head_dim, k_scale, v_scale)
    from wise_torch.kernels import fused
    q = torch.empty(n, heads, head_dim, dtype=qkv.dtype, device=device)
    fused.rope_store_kv(qkv, positions, cos_sin, k_plane, v_plane, slot_mapping, q,
                        heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    return q


def _check_scales(k_scale, v_scale, k_plane) -> bool:
    """rope_store_kv's k_scale, v_scale: both None (a plane of the model's dtype), or both float32
    [num_pages, page_size, kv_heads] (k_plane's shape without head_dim: an fp8 plane) -> whether
    they are given."""
    if k_scale is None and v_scale is None:
        return False
    want = list(k_plane.shape[:-1]) if isinstance(k_plane, torch.Tensor) else "k_plane's shape without head_dim"
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or list(t.shape) != want:
            got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"k_scale and v_scale must both be None or both float32{want} (an fp8 plane's scales, "
                             f"one per (token, KV head)), got {name} {got}")
    return True


# -- SiLU * up ------------------------------------------------------------------------------------------
def silu_mul(gate_up: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """SwiGLU's activation on a fused gate/up projection: `silu(gate) * up`.

    gate_up: [n, 2 * inter] (gate half first, up half second) -> [n, inter] in its dtype, rounded
    as torch rounds `F.silu(gate) * up`: silu in float32 (x / (1 + exp(-x))) rounded to the dtype,
    then the product rounded.

    Triton against torch: the same float32 formula and roundings. On CUDA it calls the CUDA math
    library's expf (libdevice) and IEEE division as torch's CUDA kernel does, so the two are
    expected bitwise equal (the `gpu` test checks it). Under the interpreter exp is numpy's:
    float32 |y - y_torch| <= 16 * 2^-24 * |y_torch| (each exp within 2 ulp, 1 + exp(-x) passes
    no more than that relative difference on, three roundings per side); bfloat16 / float16:
    <= 2 ulp. Rows are independent.
    """
    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even width (gate | up), got shape {tuple(gate_up.shape)}")
    inter = gate_up.shape[1] // 2
    if not _use_triton(impl, gate_up.device):
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    from wise_torch.kernels import fused
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    fused.silu_mul(gate_up, out)
    return out
