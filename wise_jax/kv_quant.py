"""The fp8 K/V cache's quantization rule in JAX: `wise_core.kv_quant` (the numpy specification,
whose docstring states the rule) as pure jnp functions, jittable (`dequantize`'s dtype static),
bitwise the same codes, scales and dequantized values.

    quantize(x) -> (codes uint8 [..., kv_heads, head_dim], scales float32 [..., kv_heads])
    dequantize(codes, scales, dtype) -> dtype [..., kv_heads, head_dim]

The rounding to e4m3fn is XLA's float32 -> float8_e4m3fn conversion (round to nearest even) of
values already saturated to +-448, bitcast to uint8; non-finite entries are set to `NAN_CODE`
explicitly. The rule multiplies by a float32 reciprocal where a division might be expected
because XLA rewrites such divisions into exactly that (`wise_core.kv_quant`, "Why").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from wise_core import kv_quant as spec


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., kv_heads, head_dim] (float32, bfloat16 or float16) -> (codes uint8 [..., kv_heads,
    head_dim], scales float32 [..., kv_heads]) (`wise_core.kv_quant.quantize`)."""
    x = jnp.asarray(x)
    spec.check_quantize_input(tuple(x.shape), jnp.dtype(x.dtype).name)
    x32 = x.astype(jnp.float32)
    finite = jnp.isfinite(x32)
    amax = jnp.max(jnp.where(finite, jnp.abs(x32), jnp.float32(0)), axis=-1)
    scale = amax * jnp.float32(spec.INV_E4M3_MAX)
    scale = jnp.where(scale >= jnp.float32(spec.MIN_SCALE), scale, jnp.float32(1))
    inv = jnp.float32(1) / scale
    y = jnp.clip(x32 * inv[..., None], jnp.float32(-spec.E4M3_MAX), jnp.float32(spec.E4M3_MAX))
    codes = lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8)
    return jnp.where(finite, codes, jnp.uint8(spec.NAN_CODE)), scale


def dequantize(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """codes uint8 [..., kv_heads, head_dim], scales float32 [..., kv_heads] -> `dtype` (float32,
    bfloat16 or float16; static under jit): value(code) * scale in float32, rounded once to dtype
    (`wise_core.kv_quant.dequantize`)."""
    codes, scales = jnp.asarray(codes), jnp.asarray(scales)
    name = spec.dtype_name(jnp.dtype(dtype))
    spec.check_dequantize_input(tuple(codes.shape), jnp.dtype(codes.dtype).name, tuple(scales.shape),
                                jnp.dtype(scales.dtype).name, name)
    values = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32) * scales[..., None]
    return values.astype(name)
