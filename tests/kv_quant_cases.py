"""Inputs of the fp8 K/V quantization tests (`wise_core.kv_quant` and its torch and JAX
implementations): K/V-like random arrays, the special vectors, and the float32 values next to
every e4m3fn rounding decision."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from wise_core import kv_quant

TINY = np.finfo(np.float32).tiny          # 2**-126, the smallest normal float32
BIG = np.finfo(np.float32).max
LOW_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
KINDS = ("normal", "outliers", "magnitudes", "tiny", "huge")
SHAPES = ((1, 1), (3, 5), (2, 7, 4, 128), (16, 2, 64))


def bits(x) -> np.ndarray:
    """x (an array or a CPU tensor) as numpy, float32 as its uint32 bits: compares NaN and -0 bitwise."""
    x = np.asarray(x)
    return x.view(np.uint32) if x.dtype == np.float32 else x


def random_kv(shape, kind: str, seed: int = 0) -> np.ndarray:
    """float32 K/V-like values of `shape` [..., kv_heads, head_dim]:
    normal: N(0, 1); outliers: N(0, 1) with a few head_dim channels x10 (as real keys have);
    magnitudes: each vector's own scale, 2**-40..2**40 (and some vectors of zeros); tiny: vectors
    whose largest value lies near 448 * MIN_SCALE, with float32 subnormals among them; huge:
    values up to float32's largest."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    head_dim = shape[-1]
    if kind == "outliers":
        channels = rng.choice(head_dim, size=max(1, head_dim // 32), replace=False)
        x[..., channels] *= 10.0
    elif kind == "magnitudes":
        x *= 2.0 ** rng.uniform(-40, 40, shape[:-1] + (1,))
        x *= rng.random(shape[:-1] + (1,)) > 0.05
    elif kind == "tiny":
        x *= 448 * kv_quant.MIN_SCALE * 2.0 ** rng.uniform(-4, 4, shape[:-1] + (1,))
        x *= np.where(rng.random(shape) < 0.3, 2.0 ** -95, 1.0)       # some entries subnormal
    elif kind == "huge":
        x = x / np.abs(x).max() * BIG * rng.uniform(0.5, 1.0, shape[:-1] + (1,))
    elif kind != "normal":
        raise ValueError(kind)
    return x.astype(np.float32)


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to `dtype` (float32, bfloat16, float16), as that numpy dtype."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(LOW_DTYPES[dtype])


def _vector(values, head_dim: int, fill: float = 0.5) -> np.ndarray:
    v = np.full(head_dim, fill, np.float32)
    v[:len(values)] = values
    return v


def special_vectors(head_dim: int = 16) -> dict[str, np.ndarray]:
    """name -> float32[head_dim]: the vectors the rule treats specially."""
    threshold = np.float32(kv_quant.MIN_SCALE / kv_quant.INV_E4M3_MAX)   # amax whose scale is MIN_SCALE
    below = np.nextafter(threshold, np.float32(0))
    above = np.nextafter(threshold, np.float32(np.inf))
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    return {
        "zeros": np.zeros(head_dim, np.float32),
        "negative zeros": np.full(head_dim, -0.0, np.float32),
        "signed zeros": _vector([0.0, -0.0] * (head_dim // 2), head_dim),
        "one value": _vector([3.0], head_dim, 0.0),
        "one negative value": _vector([-3.0], head_dim, -0.0),
        "nan": _vector([nan, 1.0, -2.0], head_dim),
        "negative nan": _vector([-nan, 1.0, -2.0], head_dim),
        "inf": _vector([inf, 1.0, -2.0], head_dim),
        "-inf": _vector([-inf, 1.0, -2.0], head_dim),
        "all nan": np.full(head_dim, nan, np.float32),
        "all inf": _vector([inf, -inf] * (head_dim // 2), head_dim),
        "nan and inf only": _vector([nan, inf, -inf], head_dim, nan),
        "subnormals only": _vector([1e-40, -3e-41, 1.4e-45], head_dim, 1e-39),
        "subnormals beside normals": _vector([1.0, -1e-40, 1e-40, TINY, -TINY], head_dim, 1e-38),
        "scale just below MIN_SCALE": _vector([below, -below / 3], head_dim, below / 7),
        "scale at MIN_SCALE": _vector([threshold, -threshold / 3, 1e-40], head_dim, threshold / 7),
        "scale just above MIN_SCALE": _vector([-above, above / 3, -1e-40], head_dim, above / 7),
        "float32 max": _vector([BIG, -BIG, BIG / 3, 1.0], head_dim, BIG / 448),
        "amax 448 (scale 1)": _vector([448.0, 464.0 / 2, 0.5 * 2.0 ** -9, 1.5 * 2.0 ** -9], head_dim, 0.0),
    }


def tie_vector() -> np.ndarray:
    """float32[1 + 2 * 126]: 448 (so the scale is exactly 1 and x * inv = x), then every
    midpoint between consecutive non-negative finite e4m3fn values, and their negatives: each
    must round to the even code."""
    values = kv_quant.E4M3FN_VALUES[:0x7F].astype(np.float64)
    midpoints = ((values[:-1] + values[1:]) / 2).astype(np.float32)   # exact in float32
    return np.concatenate([[448.0], midpoints, -midpoints]).astype(np.float32)


def decision_neighbourhoods(ulps: int = 40) -> np.ndarray:
    """float32: every non-negative finite e4m3fn value and every midpoint between consecutive
    ones (where rounding decides), each with the `ulps` float32 values on either side, the
    saturation boundary (448..464 and beyond), and their negatives."""
    values = kv_quant.E4M3FN_VALUES[:0x7F].astype(np.float64)
    anchors = np.concatenate([values, (values[:-1] + values[1:]) / 2, [464.0, 480.0]]).astype(np.float32)
    offsets = np.arange(-ulps, ulps + 1, dtype=np.int64)
    bits = anchors.view(np.uint32).astype(np.int64)[:, None] + offsets[None, :]
    bits = np.unique(bits[bits >= 0]).astype(np.uint32)
    y = bits.view(np.float32)
    return np.concatenate([y, -y])


def decision_rows(ulps: int = 40, head_dim: int = 128) -> np.ndarray:
    """`decision_neighbourhoods` within +-448 packed as K/V float32 [n, 1, head_dim]: each vector
    holds 448 (its scale 1, so every value quantizes as itself) and head_dim - 1 of the values, the
    last vector padded with the last value."""
    y = decision_neighbourhoods(ulps)
    y = y[np.abs(y) <= 448]
    n = -(-y.size // (head_dim - 1))
    x = np.full((n, 1, head_dim), y[-1], np.float32)
    x[:, 0, 0] = 448.0
    x[:, 0, 1:].reshape(-1)[:y.size] = y
    return x


def nearest_code(y: np.ndarray) -> np.ndarray:
    """An independent oracle of the rounding: the code of the e4m3fn value nearest to y (ties to
    the even code), finite y saturated to +-448 first, NaN and +-inf -> NAN_CODE. Slow: small
    inputs only."""
    y = np.asarray(y, np.float32)
    values = kv_quant.E4M3FN_VALUES[:0x7F].astype(np.float64)        # 0 .. 448, codes 0 .. 0x7E
    a = np.minimum(np.abs(y.astype(np.float64)), 448.0)
    distance = np.abs(a[..., None] - values)
    best = distance.min(-1, keepdims=True)
    candidates = np.where(distance == best, np.arange(0x7F), 10_000)
    even = np.where(candidates % 2 == 0, candidates, 10_000).min(-1)
    code = np.where(even < 10_000, even, candidates.min(-1))        # a tie has an even candidate
    code = code | np.where(np.signbit(y), 0x80, 0)
    return np.where(np.isfinite(y), code, kv_quant.NAN_CODE).astype(np.uint8)


def exhaustive_rows(start: int, stop: int, stride: int = 1, head_dim: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """The float32 values of bit patterns range(start, stop, stride) (non-negative, <= 448), laid
    out as vectors [n, 1, head_dim] whose first entry is 448: each vector's scale is exactly 1
    (RN(448 * C) = 1), so x * inv = x and its codes are the rounding of the values themselves.
    Returns (x, the spec's codes for it); padding repeats the last value."""
    bits = np.arange(start, stop, stride, dtype=np.uint32)
    per_row = head_dim - 1
    n = -(-bits.size // per_row)
    bits = np.concatenate([bits, np.full(n * per_row - bits.size, bits[-1], np.uint32)])
    x = np.empty((n, 1, head_dim), np.float32)
    x[:, 0, 0] = 448.0
    x[:, 0, 1:] = bits.view(np.float32).reshape(n, per_row)
    return x, kv_quant.encode_e4m3fn(x)


def exhaustive_stride() -> int:
    """The stride of the framework tests' sweep over the float32 bit patterns up to 448: 61 (a
    prime: 19 million values, every residue of the mantissa's low bits in every binade), or 1
    (all 1.14e9, about a minute each) with WISE_KV_QUANT_EXHAUSTIVE=1."""
    return 1 if os.environ.get("WISE_KV_QUANT_EXHAUSTIVE") == "1" else 61


def same_values(got: np.ndarray, want: np.ndarray) -> bool:
    """Bitwise equal, except that a NaN matches any NaN (dequantized NaN payloads are not
    specified: `wise_core.kv_quant`)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    got_nan, want_nan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    view = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    return bool(np.array_equal(got_nan, want_nan)
                and np.array_equal(got.view(view)[~got_nan], want.view(view)[~want_nan]))
