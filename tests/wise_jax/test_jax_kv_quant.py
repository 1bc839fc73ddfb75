"""wise_jax.kv_quant against the numpy specification (wise_core.kv_quant), bitwise: codes,
scales and dequantized values (NaN payloads aside), jit-compiled and eager, on random K/V of
several shapes, kinds and input dtypes, the special vectors, every tie, values at rounding edges, values at rounding edges, and (slow) float32
values up to 448 through the public quantize. On JAX's default device (the GPU when there is one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kv_quant_cases import KINDS, LOW_DTYPES, SHAPES, decision_rows, exhaustive_rows, \
    exhaustive_stride, random_kv, rounded, same_values, special_vectors, tie_vector
from parity.kv_quant import rounding_edges
from wise_core import kv_quant as spec
from wise_jax import kv_quant as K

JAX_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
quantize = jax.jit(K.quantize)
dequantize = jax.jit(K.dequantize, static_argnums=2)


def assert_matches_spec(x: np.ndarray, *, eager: bool = False) -> None:
    """quantize and dequantize (every output dtype), jitted (and eager), bitwise equal to the spec's on x."""
    want_codes, want_scales = spec.quantize(x)
    for quantize_fn, dequantize_fn in [(quantize, dequantize)] + [(K.quantize, K.dequantize)] * eager:
        codes, scales = quantize_fn(jnp.asarray(x))
        assert codes.dtype == jnp.uint8 and scales.dtype == jnp.float32
        got_codes, got_scales = np.asarray(codes), np.asarray(scales)
        differ = np.flatnonzero(got_codes != want_codes)
        assert differ.size == 0, f"{differ.size} codes differ, first at {differ[0]}: x={x.reshape(-1)[differ[0]]!r} " \
            f"jax {got_codes.reshape(-1)[differ[0]]:#x} spec {want_codes.reshape(-1)[differ[0]]:#x}"
        assert np.array_equal(got_scales.view(np.uint32), want_scales.view(np.uint32))
        for name, dtype in JAX_DTYPES.items():
            got = np.asarray(dequantize_fn(codes, scales, dtype))
            assert same_values(got, spec.dequantize(want_codes, want_scales, name)), name


@pytest.mark.parametrize("dtype", list(LOW_DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_random_kv_matches_the_spec(kind, dtype):
    for i, shape in enumerate(SHAPES):
        assert_matches_spec(rounded(random_kv(shape, kind, seed=i), dtype), eager=i == 1)


def test_special_vectors_and_ties_match_the_spec():
    for dtype in LOW_DTYPES:
        assert_matches_spec(rounded(np.stack(list(special_vectors(16).values()))[:, None, :], dtype), eager=True)
    assert_matches_spec(tie_vector()[None], eager=True)
    codes, scales = quantize(jnp.asarray(tie_vector()[None]))
    assert np.asarray(scales).tolist() == [1.0] and int(codes[0, 0]) == 0x7E


def test_every_rounding_decision_matches_the_spec():
    assert_matches_spec(decision_rows(ulps=40))


def test_values_at_rounding_edges_match_the_spec():
    """Values whose x * inv lies within float32 ulps of an e4m3fn midpoint: a division in place
    of the multiplication by the reciprocal (what XLA's rewrite would be the other way round)
    changes a quarter of these codes."""
    assert_matches_spec(rounding_edges(np.random.default_rng(0), 512, 64)[:, None, :])


def test_non_finite_entries_become_the_nan_code():
    x = np.array([[[np.nan, -np.nan, np.inf, -np.inf, 1.0, -2.0]]], np.float32)
    codes, scales = quantize(jnp.asarray(x))
    assert np.asarray(codes).tolist() == [[[0x7F] * 4 + spec.quantize(x)[0][0, 0, 4:].tolist()]]
    back = np.asarray(dequantize(codes, scales, jnp.float32))
    assert np.isnan(back[0, 0, :4]).all() and np.isfinite(back[0, 0, 4:]).all()


def test_dequantize_accepts_dtype_names_and_numpy_dtypes():
    codes, scales = quantize(jnp.ones((2, 8), jnp.float32))
    for dtype in ("bfloat16", np.float16, LOW_DTYPES["bfloat16"], jnp.float32):
        assert K.dequantize(codes, scales, dtype).dtype == jnp.dtype(dtype)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        K.quantize(jnp.ones(8))
    with pytest.raises(ValueError, match="must be one of"):
        K.quantize(jnp.ones((2, 8), jnp.int32))
    codes, scales = K.quantize(jnp.ones((2, 8)))
    with pytest.raises(ValueError, match="codes must be uint8"):
        K.dequantize(codes.astype(jnp.int8), scales, jnp.float32)
    with pytest.raises(ValueError, match="scales must be float32"):
        K.dequantize(codes, scales[:1], jnp.float32)
    with pytest.raises(ValueError, match="dtype must be one of"):
        K.dequantize(codes, scales, jnp.int32)


@pytest.mark.slow
def test_float32_values_up_to_448_match_the_spec():
    """XLA's float8 conversion on the values the rule can hand it (non-negative: negatives differ
    in the sign bit, covered above), through the public quantize (vectors of scale 1): every 61st
    float32 bit pattern up to 448, or every one with WISE_KV_QUANT_EXHAUSTIVE=1
    (`kv_quant_cases.exhaustive_stride`). One chunk shape: one compilation."""
    stride = exhaustive_stride()
    end, rows = 0x43E00000 + 1, 1 << 17
    chunk = stride * 127 * rows
    for start in range(0, end, chunk):
        x, want = exhaustive_rows(start, min(start + chunk, end), stride)
        x = np.concatenate([x, np.repeat(x[-1:], rows - len(x), 0)])   # pad to one shape
        got = np.asarray(quantize(jnp.asarray(x))[0])[:len(want)]
        assert np.array_equal(got, want), f"differs at {x[:len(want)][got != want][0]!r}"
