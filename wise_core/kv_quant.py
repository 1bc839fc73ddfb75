"""The fp8 K/V cache's quantization rule (issue 50), in numpy: the specification that
`wise_torch.kv_quant` and `wise_jax.kv_quant` compute bitwise (same codes, same scales, same
dequantized values on the same inputs).

    quantize(x) -> (codes, scales)          x: float32 / bfloat16 / float16 [..., kv_heads, head_dim]
    dequantize(codes, scales, dtype) -> x'  codes: uint8 [..., kv_heads, head_dim]
                                            scales: float32 [..., kv_heads]

codes are float8 e4m3fn bit patterns held as uint8 (the bytes a cache page holds): bit 7 the
sign, bits 6-3 the exponent (bias 7), bits 2-0 the mantissa; exponent 0 is subnormal (m * 2**-9),
0x7F and 0xFF are NaN, there is no infinity, the largest finite value is 448 (0x7E). One float32
scale per [..., kv_heads] vector of head_dim values: per token and KV head
(benchmarks/quality/kv_quant_granularity.py measured it against one scale per page of 128
tokens and KV head).

The rule. Every step is float32 arithmetic rounded to nearest, ties to even (RN):
1. x32 = float32(x): exact for every cache dtype.
2. amax = max |x32| over head_dim, over the finite entries (0 when there are none).
3. scale = RN(amax * C), C = RN(1 / 448) = float32 0x3B124925 (`INV_E4M3_MAX`); scale lies
   within half an ulp plus 4.5e-8 relative of amax / 448 (C's excess over 1 / 448), 1.25 ulps.
4. A vector whose scale is below 2**-116 (`MIN_SCALE`; amax below 448 * 2**-116 ~ 5.4e-33, the
   all-zero vector among them) gets scale = 1.
5. inv = RN(1 / scale), once per vector; y = RN(x32 * inv): x / scale as a multiplication by
   the float32 reciprocal, not a division per value.
6. y is saturated to [-448, 448], then rounded to e4m3fn (RN, ties to even; subnormals are
   2**-9 apart below 2**-6); the code keeps the sign of zero (-0.0 -> 0x80).
7. A non-finite entry (NaN, +-inf) gets code 0x7F (`NAN_CODE`), whatever its sign. It did not
   enter amax, so the vector's finite entries are quantized as if it were absent.

dequantize(codes, scales, dtype) = RN_dtype(RN(value(code) * scale)): value(code) is exact in
float32 (`E4M3FN_VALUES`; NaN for 0x7F and 0xFF), the product is float32 and is rounded once
to `dtype` (float32, bfloat16 or float16). Dequantized values are bitwise the same in the three
implementations except a NaN's payload, which is not specified (torch's float8 -> float32
conversion gives 0x7FF00000, numpy's and XLA's 0x7FC00000): a NaN is a NaN in each.

Why these choices:
- A product and a reciprocal, not divisions: XLA rewrites a division by a constant and by a
  broadcast scale into a multiplication by the reciprocal (on a CPU, 55 % of float32 amax / 448
  and 26 % of x / scale then differ from numpy's quotients: measured for this module), and
  Triton's `/` on float32 is not correctly rounded; `amax * C` and `x * inv` are computed alike
  everywhere, and the one division left, 1 / scale, is one per vector (a Triton kernel computes
  it with `tl.math.div_rn`). The scale stays amax / 448 within 1.25 ulps; amax * inv may exceed
  448 by up to two ulps, which the saturation of step 6 takes back.
- MIN_SCALE = 2**-116 keeps every step clear of float32 subnormals, so flush-to-zero arithmetic
  (XLA flushes subnormals on a CPU; GPU code may) gives the same bits: with scale >= 2**-116,
  inv <= 2**116, so a subnormal x (< 2**-126) gives |y| < 2**-10, which rounds to +-0 whether x
  was flushed or not, and a nonzero dequantized product is >= 2**-9 * 2**-116 = 2**-125, a
  normal number. The scale of a vector below it is 1 rather than 0 so that neither inv nor a
  later reader's 1 / scale is infinite: every entry of such a vector is below 2**-10 and is
  stored as a signed zero, and 1 is exact (dequantize reads those zeros back as zeros, signs
  kept). Such values are 30 orders of magnitude below any K/V that matters.
- NaN stays NaN, and an infinity must not become a finite number: e4m3fn has no infinity, so
  both become NaN (0x7F) and read back NaN (torch's own float8 cast would saturate an infinity
  to 448, ml_dtypes' and XLA's give NaN: the explicit code makes them agree). Keeping them out
  of amax keeps the other head_dim values of the token usable: in attention a NaN or inf in K
  or V already makes the outputs that read it non-finite, and they stay so.
- Per-(token, KV head) scales: a decode step appends one token to a page, and its scale depends
  on that token alone, so no byte already written is ever rewritten; the scales cost 4 bytes
  per head_dim bytes of codes (3.1 % at head_dim 128). Measured on random K/V (head_dim 128,
  benchmarks/results/cpu-2026-12-07/): attention outputs 1.04-1.6x more accurate than with one
  scale per page of 128 tokens (the page's amax known in advance), most with outlier channels.

Round trip. For a finite entry x of a vector with scale s:

    |x - dequantize(quantize(x))| <= max(2**-4 * |x|, 2**-10 * s) + 2**-21 * (|x| + 2**-10 * s)

(float32 output). y = x / s up to two roundings; e4m3fn's rounding moves y by at most half an
ulp: for |y| in [2**e, 2**(e+1)), e >= -6, the ulp is 2**(e-3), half of it 2**(e-4) <= 2**-4 * |y|;
below 2**-6 (subnormals) half the spacing, 2**-10. Multiplied back by s this is the first
term; the float32 roundings (x * inv, 1 / scale, the saturation of at most two ulps, the
product value * s) add under 7 units of 2**-24 relative, inside the second term. The largest
error in a vector is 16 * s = amax / 28 up to those roundings (half the ulp of e4m3fn's top
binade, [256, 448]). A vector with
scale 1 by step 4 is within it too (every entry is below 2**-10 and reads back as zero).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0                                  # E4M3FN's largest finite value (code 0x7E)
INV_E4M3_MAX = np.float32(1.0 / 448.0)            # C = RN(1 / 448), float32 0x3B124925
MIN_SCALE = 2.0 ** -116                           # smaller scales are replaced by 1 (step 4)
NAN_CODE = 0x7F                                   # the code of every non-finite entry
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8")                 # an engine's kv_cache_dtype (`check_kv_cache_dtype`)
SCALE_BYTES = 4                                   # one float32 scale per (token, KV head) of K or V
_NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                 "float16": np.dtype(np.float16)}


def _values() -> np.ndarray:
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 7
    magnitude = np.where(exponent == 0, mantissa * 2.0 ** -9, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = np.where(codes & 0x80, -magnitude, magnitude)   # 0x80: -0.0
    values[(codes & 0x7F) == NAN_CODE] = np.nan
    values = values.astype(np.float32)
    values.flags.writeable = False
    return values


E4M3FN_VALUES = _values()   # float32[256]: the value of each code, exact (NaN at 0x7F and 0xFF)


def dtype_name(dtype) -> str:
    """'float32', 'bfloat16' or 'float16' for such a name or numpy dtype; ValueError otherwise."""
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = repr(dtype)
    if name not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    return name


def check_quantize_input(shape: tuple[int, ...], dtype: str) -> None:
    """x of quantize: [..., kv_heads, head_dim] (head_dim >= 1) of a dtype in FLOAT_DTYPES
    (named as numpy names it). ValueError otherwise."""
    if len(shape) < 2 or shape[-1] < 1:
        raise ValueError(f"x must be [..., kv_heads, head_dim] with head_dim >= 1, got shape {tuple(shape)}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be one of {FLOAT_DTYPES}, got {dtype}")


def check_dequantize_input(codes_shape: tuple[int, ...], codes_dtype: str, scales_shape: tuple[int, ...],
                           scales_dtype: str, dtype: str) -> None:
    """codes uint8[..., kv_heads, head_dim], scales float32[..., kv_heads] (codes' shape without
    its last axis), dtype in FLOAT_DTYPES (numpy names). ValueError otherwise."""
    if len(codes_shape) < 2 or codes_shape[-1] < 1 or codes_dtype != "uint8":
        raise ValueError(f"codes must be uint8[..., kv_heads, head_dim], got {codes_dtype}{list(codes_shape)}")
    if tuple(scales_shape) != tuple(codes_shape[:-1]) or scales_dtype != "float32":
        raise ValueError(f"scales must be float32{list(codes_shape[:-1])} (codes' shape without head_dim), "
                         f"got {scales_dtype}{list(scales_shape)}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")


def encode_e4m3fn(y: np.ndarray) -> np.ndarray:
    """float32 -> uint8 e4m3fn codes: round to nearest, ties to even; finite values saturate to
    +-448; NaN and +-inf -> NAN_CODE; the sign of zero is kept. Bit manipulation on float32,
    no float8 type: normal results (|y| >= 2**-6) round float32's 23-bit mantissa to 3 bits on
    the bit pattern (the carry runs into the exponent); below, the subnormal count is
    rint(|y| * 2**9) (the product is exact), 8 of which is 2**-6, the smallest normal, code 0x08."""
    y = np.asarray(y)
    if y.dtype != np.float32:
        raise ValueError(f"encode_e4m3fn takes float32, got {y.dtype}")
    bits = y.view(np.uint32)  # same itemsize: any layout
    sign = (bits >> 24) & 0x80
    magnitude = np.asarray(np.minimum(bits & 0x7FFFFFFF, np.uint32(0x43E00000)))  # saturate at 448 (NaN/inf: below)
    normal = magnitude >= 0x3C800000                                  # 2**-6
    # round to 3 mantissa bits, ties to even: add half an ulp less one, plus the kept lsb
    rounded = (magnitude + np.uint32(0x7FFFF) + ((magnitude >> 20) & 1)) >> 20
    normal_code = rounded - np.uint32(120 << 3)                       # float32 bias 127 -> e4m3 bias 7
    subnormal_code = np.rint(magnitude.view(np.float32) * np.float32(512)).astype(np.uint32)
    code = np.where(normal, normal_code, subnormal_code) | sign
    return np.where(np.isfinite(y), code, NAN_CODE).astype(np.uint8)


def decode_e4m3fn(codes: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes -> their float32 values (exact; NaN for 0x7F and 0xFF)."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"decode_e4m3fn takes uint8 codes, got {codes.dtype}")
    return E4M3FN_VALUES[codes]


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., kv_heads, head_dim] (float32, bfloat16 or float16) -> (codes uint8 [..., kv_heads,
    head_dim], scales float32 [..., kv_heads]) by the rule of this module's docstring."""
    x = np.asarray(x)
    check_quantize_input(x.shape, x.dtype.name)
    x32 = x.astype(np.float32)
    finite = np.isfinite(x32)
    amax = np.max(np.where(finite, np.abs(x32), np.float32(0)), axis=-1)
    scale = amax * INV_E4M3_MAX
    scale = np.where(scale >= np.float32(MIN_SCALE), scale, np.float32(1)).astype(np.float32)
    inv = np.float32(1) / scale
    y = x32 * inv[..., None]                  # finite x: |y| <= 448 + 2 ulps (encode saturates)
    return np.where(finite, encode_e4m3fn(y), np.uint8(NAN_CODE)), scale


def dequantize(codes: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """codes uint8 [..., kv_heads, head_dim], scales float32 [..., kv_heads] -> values of `dtype`
    (float32, bfloat16 or float16, as a name or numpy dtype): value(code) * scale in float32,
    rounded once to dtype."""
    codes, scales = np.asarray(codes), np.asarray(scales)
    name = dtype_name(dtype)
    check_dequantize_input(codes.shape, codes.dtype.name, scales.shape, scales.dtype.name, name)
    values = decode_e4m3fn(codes) * scales[..., None]
    with np.errstate(over="ignore"):  # float16 overflows to inf above 65504, as its cast does
        return values.astype(_NUMPY_DTYPES[name])


def check_kv_cache_dtype(value) -> str:
    """An engine's or cache's kv_cache_dtype: "auto" (K/V held in the model's dtype) or "fp8"
    (e4m3fn codes, a byte a value, and a float32 scale per (token, KV head), by this module's
    rule); ValueError otherwise."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {value!r}")
    return value


def entry_bytes(head_dim: int, itemsize: int, kv_cache_dtype: str) -> int:
    """Bytes one (token, KV head) of K (or of V) takes in a cache: head_dim values of `itemsize`
    bytes ("auto": the model's dtype), or head_dim one-byte codes and a float32 scale ("fp8")."""
    if check_kv_cache_dtype(kv_cache_dtype) == "fp8":
        return head_dim + SCALE_BYTES
    return head_dim * itemsize
