"""wise_core.kv_quant, the fp8 K/V quantization rule: the e4m3fn table and rounding against
ml_dtypes and an independent nearest-value oracle (every code, every tie, the float32 values
around each rounding decision, random bit patterns; every non-negative float32 up to 448 in the
slow test), then the rule itself: the scale, MIN_SCALE, saturation, zero vectors, NaN and
infinities, signs, input dtypes, indifference to flushed subnormals, and the round-trip bound
of the module's docstring."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kv_quant_cases import KINDS, LOW_DTYPES, SHAPES, decision_neighbourhoods, nearest_code, random_kv, \
    rounded, special_vectors, tie_vector
from parity.kv_quant import rounding_edges
from wise_core import kv_quant as K

CODES = np.arange(256, dtype=np.uint8)
FINITE_CODES = CODES[(CODES & 0x7F) != 0x7F]


def ml_codes(y: np.ndarray) -> np.ndarray:
    """ml_dtypes' float32 -> float8_e4m3fn cast of y saturated to +-448 (ml_dtypes gives NaN above
    464), NaN and +-inf -> NAN_CODE: what encode_e4m3fn specifies."""
    y = np.asarray(y, np.float32)
    with np.errstate(invalid="ignore"):
        codes = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.where(np.isfinite(y), codes, K.NAN_CODE).astype(np.uint8)


def bits(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# -- the format ------------------------------------------------------------------------------------
def test_the_table_is_e4m3fn():
    want = CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(np.isnan(K.E4M3FN_VALUES), np.isnan(want))
    assert np.flatnonzero(np.isnan(K.E4M3FN_VALUES)).tolist() == [0x7F, 0xFF]
    assert np.array_equal(bits(K.E4M3FN_VALUES[FINITE_CODES]), bits(want[FINITE_CODES]))
    assert (K.E4M3FN_VALUES[0x7E], K.E4M3FN_VALUES[0x08], K.E4M3FN_VALUES[0x01], K.E4M3FN_VALUES[0x38]) \
        == (448.0, 2.0 ** -6, 2.0 ** -9, 1.0)
    assert bits(K.E4M3FN_VALUES[0x80]) == bits(np.float32(-0.0))
    assert K.E4M3_MAX == np.nanmax(K.E4M3FN_VALUES) and K.INV_E4M3_MAX.view(np.uint32) == 0x3B124925
    assert np.array_equal(K.decode_e4m3fn(CODES)[FINITE_CODES], K.E4M3FN_VALUES[FINITE_CODES])
    assert not K.E4M3FN_VALUES.flags.writeable


def test_every_code_encodes_to_itself():
    assert np.array_equal(K.encode_e4m3fn(K.E4M3FN_VALUES[FINITE_CODES]), FINITE_CODES)
    assert K.encode_e4m3fn(K.E4M3FN_VALUES[[0x7F, 0xFF]]).tolist() == [K.NAN_CODE, K.NAN_CODE]


def test_ties_round_to_the_even_code():
    values = K.E4M3FN_VALUES[:0x7F].astype(np.float64)
    midpoints = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    assert np.array_equal(midpoints.astype(np.float64), (values[:-1] + values[1:]) / 2)   # exact
    even = np.arange(126) + (np.arange(126) % 2)          # between codes i and i + 1: the even one
    assert np.array_equal(K.encode_e4m3fn(midpoints), even)
    assert np.array_equal(K.encode_e4m3fn(-midpoints), even | 0x80)
    assert np.array_equal(ml_codes(midpoints), even)


def test_rounding_around_every_decision_matches_ml_dtypes_and_the_nearest_value():
    y = decision_neighbourhoods(ulps=40)
    got = K.encode_e4m3fn(y)
    assert np.array_equal(got, ml_codes(y))
    assert np.array_equal(got, nearest_code(y))


def test_rounding_of_random_float32_bit_patterns():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2 ** 32, 1 << 21, dtype=np.uint64).astype(np.uint32).view(np.float32)  # NaN, inf too
    assert np.array_equal(K.encode_e4m3fn(y), ml_codes(y))
    small = (rng.uniform(-1, 1, 1 << 20) * 2.0 ** rng.uniform(-20, 9.5, 1 << 20)).astype(np.float32)
    assert np.array_equal(K.encode_e4m3fn(small), ml_codes(small))
    assert np.array_equal(K.encode_e4m3fn(small[:2000]), nearest_code(small[:2000]))


def test_saturation_signed_zero_and_non_finite_codes():
    y = np.array([448, 460, 464, 479.9, 480, 1e30, np.finfo(np.float32).max], np.float32)
    assert K.encode_e4m3fn(y).tolist() == [0x7E] * len(y)
    assert K.encode_e4m3fn(-y).tolist() == [0xFE] * len(y)
    assert K.encode_e4m3fn(np.array([0.0, -0.0, 1e-45, -1e-45, 2.0 ** -10, -2.0 ** -10], np.float32)).tolist() \
        == [0x00, 0x80, 0x00, 0x80, 0x00, 0x80]
    assert K.encode_e4m3fn(np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32)).tolist() == [K.NAN_CODE] * 4
    assert K.encode_e4m3fn(np.float32(1.0)).shape == ()
    with pytest.raises(ValueError, match="float32"):
        K.encode_e4m3fn(np.ones(3))


@pytest.mark.slow
def test_rounding_of_every_non_negative_float32_up_to_448():
    """All 1.14e9 of them against ml_dtypes, in chunks (about 2 minutes on 2 cores); negatives
    differ only by the sign bit, which the random and neighbourhood tests cover."""
    end, chunk = 0x43E00000, 1 << 24
    for start in range(0, end + 1, chunk):
        y = np.arange(start, min(start + chunk, end + 1), dtype=np.uint32).view(np.float32)
        got, want = K.encode_e4m3fn(y), ml_codes(y)
        assert np.array_equal(got, want), f"differs at {y[np.flatnonzero(got != want)[0]]!r}"


# -- the rule ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_scale_is_amax_times_the_float32_reciprocal_of_448(kind):
    x = random_kv((64, 8, 32), kind, seed=1)
    codes, scales = K.quantize(x)
    amax = np.abs(x).max(-1)
    want = (amax * K.INV_E4M3_MAX).astype(np.float32)
    want = np.where(want >= K.MIN_SCALE, want, np.float32(1))
    assert scales.dtype == np.float32 and np.array_equal(bits(scales), bits(want))
    kept = want != 1
    quotient = amax.astype(np.float64)[kept] / 448
    # amax / 448 within half an ulp (the product's rounding) plus C's excess over 1 / 448
    assert np.all(np.abs(scales[kept] - quotient) <= 0.5 * np.spacing(scales[kept]) + 4.5e-8 * quotient)
    assert np.all(np.abs(scales[kept] - quotient) <= 1.25 * np.spacing(scales[kept]))
    # each vector's largest entry reaches the top code (amax * inv overshoots 448 by <= 2 ulps: saturated)
    top = np.take_along_axis(codes, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    assert np.all((top[kept] & 0x7F) == 0x7E)


def test_reciprocal_overshoot_is_within_two_ulps_of_448():
    rng = np.random.default_rng(2)
    amax = (2.0 ** rng.uniform(-100, 127, 1 << 20)).astype(np.float32)
    scale = amax * K.INV_E4M3_MAX
    y = amax * (np.float32(1) / scale)
    assert np.all(np.abs(y - 448) <= 2 * np.spacing(np.float32(448)))


def test_codes_are_the_encoded_products_with_the_reciprocal():
    x = random_kv((32, 4, 64), "magnitudes", seed=3)
    codes, scales = K.quantize(x)
    inv = np.float32(1) / scales
    assert np.array_equal(codes, K.encode_e4m3fn(x * inv[..., None]))
    assert np.array_equal(codes, nearest_code(x * inv[..., None]))
    assert codes.dtype == np.uint8 and codes.shape == x.shape and scales.shape == x.shape[:-1]


def test_a_division_by_the_scale_would_change_codes_at_rounding_edges():
    """Why the rule multiplies by the float32 reciprocal and says so: x / scale and x * inv
    differ by an ulp for a quarter of float32 values, which changes the code where x * inv lies
    next to an e4m3fn midpoint (`parity.kv_quant.rounding_edges` builds such values)."""
    x = rounding_edges(np.random.default_rng(0), 256, 64)
    codes, scales = K.quantize(x)
    inv = np.float32(1) / scales
    assert np.array_equal(codes, nearest_code(x * inv[:, None]))
    divided = K.encode_e4m3fn((x / scales[:, None]).astype(np.float32))
    assert np.mean(divided != codes) > 0.1


def test_special_vectors():
    cases = special_vectors(16)
    out = {name: K.quantize(v[None]) for name, v in cases.items()}
    for name in ("zeros", "subnormals only", "scale just below MIN_SCALE"):
        codes, scales = out[name]
        assert scales.tolist() == [1.0] and np.all((codes & 0x7F) == 0), name
    assert out["negative zeros"][0].tolist() == [[0x80] * 16]
    assert out["signed zeros"][0].tolist() == [[0x00, 0x80] * 8]
    for name in ("scale at MIN_SCALE", "scale just above MIN_SCALE"):
        assert out[name][1].tolist() == [K.MIN_SCALE] and (out[name][0][0, 0] & 0x7F) == 0x7E, name
    assert out["amax 448 (scale 1)"][1].tolist() == [1.0]
    assert out["float32 max"][1][0] == np.float32(np.finfo(np.float32).max) * K.INV_E4M3_MAX
    # 448 * scale stays finite at float32's largest amax
    assert np.isfinite(K.dequantize(*out["float32 max"], np.float32)).all()
    for name in ("all nan", "all inf", "nan and inf only"):
        codes, scales = out[name]
        assert scales.tolist() == [1.0] and np.all(codes == K.NAN_CODE), name


@pytest.mark.parametrize("name", ["nan", "negative nan", "inf", "-inf"])
def test_non_finite_entries_read_back_nan_and_leave_the_rest_as_if_absent(name):
    v = special_vectors(16)[name]
    codes, scales = K.quantize(v[None])
    assert codes[0, 0] == K.NAN_CODE
    absent = v.copy()
    absent[0] = 0.0                               # below amax: the vector's scale and codes unchanged
    want_codes, want_scales = K.quantize(absent[None])
    assert np.array_equal(scales, want_scales) and np.array_equal(codes[:, 1:], want_codes[:, 1:])
    for dtype in LOW_DTYPES:
        back = K.dequantize(codes, scales, dtype).astype(np.float32)
        assert np.isnan(back[0, 0]) and np.isfinite(back[0, 1:]).all()


def test_ties_inside_a_vector_round_to_even():
    x = tie_vector()
    codes, scales = K.quantize(x[None])
    assert scales.tolist() == [1.0]               # RN(448 * C) = 1, so x * inv = x
    even = np.arange(126) + (np.arange(126) % 2)
    assert codes[0, 0] == 0x7E and np.array_equal(codes[0, 1:127], even)
    assert np.array_equal(codes[0, 127:], even | 0x80)


@pytest.mark.parametrize("kind", KINDS)
def test_negation_flips_only_the_sign_bits(kind):
    x = random_kv((16, 4, 32), kind, seed=4)
    codes, scales = K.quantize(x)
    neg_codes, neg_scales = K.quantize(-x)
    assert np.array_equal(bits(neg_scales), bits(scales)) and np.array_equal(neg_codes, codes ^ 0x80)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["normal", "outliers", "magnitudes", "tiny"])
def test_low_precision_inputs_quantize_as_their_float32_values(dtype, kind):
    x = rounded(random_kv((8, 4, 64), kind, seed=5), dtype)
    codes, scales = K.quantize(x)
    want_codes, want_scales = K.quantize(x.astype(np.float32))
    assert np.array_equal(codes, want_codes) and np.array_equal(bits(scales), bits(want_scales))


@pytest.mark.parametrize("kind", ["tiny", "magnitudes", "normal"])
def test_flushed_subnormals_give_the_same_codes(kind):
    """The MIN_SCALE argument: an input subnormal (what flush-to-zero arithmetic reads as a
    signed zero) never changes a code or a scale, and every nonzero dequantized value is a
    normal float32."""
    x = random_kv((128, 4, 32), kind, seed=6)
    assert kind != "tiny" or np.any((x != 0) & (np.abs(x) < np.finfo(np.float32).tiny))
    flushed = np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), x), x)
    codes, scales = K.quantize(x)
    want_codes, want_scales = K.quantize(flushed)
    assert np.array_equal(codes, want_codes) and np.array_equal(bits(scales), bits(want_scales))
    back = K.dequantize(codes, scales, np.float32)
    assert np.all((back == 0) | (np.abs(back) >= 2.0 ** -125))


def round_trip_bound(x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The module docstring's bound: max(2**-4 |x|, 2**-10 s) + 2**-21 (|x| + 2**-10 s)."""
    a, s = np.abs(x.astype(np.float64)), scales.astype(np.float64)[..., None]
    return np.maximum(2.0 ** -4 * a, 2.0 ** -10 * s) + 2.0 ** -21 * (a + 2.0 ** -10 * s)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_within_the_bound(kind):
    x = random_kv((64, 8, 128), kind, seed=7)
    codes, scales = K.quantize(x)
    back = K.dequantize(codes, scales, np.float32)
    err = np.abs(back.astype(np.float64) - x)
    bound = round_trip_bound(x, scales)
    assert np.all(err <= bound), float(np.max(err / bound))
    # and the bound is reached within a factor 2 (half an ulp of e4m3fn: 2**-4 relative at most)
    normal = np.abs(x) >= 2.0 ** -6 * scales[..., None]
    assert np.max(err[normal] / np.abs(x[normal])) > 2.0 ** -5
    # per vector: at most half the top binade's ulp, 16 * scale = amax / 28
    assert np.all(err.max(-1) <= 16 * scales * (1 + 2.0 ** -20))


def test_round_trip_bound_holds_for_the_special_vectors():
    for name, v in special_vectors(16).items():
        codes, scales = K.quantize(v[None])
        back = K.dequantize(codes, scales, np.float32)
        finite = np.isfinite(v[None])
        err = np.abs(back.astype(np.float64) - v)[finite]
        assert np.all(err <= round_trip_bound(v[None], scales)[finite]), name


@pytest.mark.parametrize("dtype", list(LOW_DTYPES))
def test_dequantize_is_the_float32_product_rounded_once(dtype):
    x = random_kv((32, 4, 64), "magnitudes", seed=8)
    x[0, 0, :3] = [np.nan, np.inf, -np.inf]
    codes, scales = K.quantize(x)
    exact = K.E4M3FN_VALUES[codes].astype(np.float64) * scales[..., None]   # exact: 24 + 4 bits
    want = rounded(exact.astype(np.float32), dtype)
    got = K.dequantize(codes, scales, dtype)
    assert got.dtype == LOW_DTYPES[dtype] and got.shape == x.shape
    assert np.array_equal(np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32)))
    assert np.array_equal(bits(got)[~np.isnan(want.astype(np.float32))], bits(want)[~np.isnan(want.astype(np.float32))])
    assert np.array_equal(bits(K.dequantize(codes, scales, LOW_DTYPES[dtype])), bits(got))  # numpy dtype too


@pytest.mark.parametrize("shape", SHAPES)
def test_shapes(shape):
    codes, scales = K.quantize(random_kv(shape, "normal"))
    assert (codes.shape, codes.dtype, scales.shape, scales.dtype) == (shape, np.uint8, shape[:-1], np.float32)
    assert K.dequantize(codes, scales, "bfloat16").shape == shape


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        K.quantize(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="head_dim >= 1"):
        K.quantize(np.ones((2, 0), np.float32))
    with pytest.raises(ValueError, match="must be one of"):
        K.quantize(np.ones((2, 8), np.float64))
    codes, scales = K.quantize(np.ones((2, 8), np.float32))
    with pytest.raises(ValueError, match="codes must be uint8"):
        K.dequantize(codes.astype(np.int8), scales, "float32")
    with pytest.raises(ValueError, match="scales must be float32"):
        K.dequantize(codes, scales[:1], "float32")
    with pytest.raises(ValueError, match="scales must be float32"):
        K.dequantize(codes, scales.astype(np.float64), "float32")
    with pytest.raises(ValueError, match="dtype must be one of"):
        K.dequantize(codes, scales, np.float64)
