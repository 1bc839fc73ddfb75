"""wise_torch.kv_quant against the numpy specification (wise_core.kv_quant), bitwise: codes,
scales and dequantized values (NaN payloads aside) on random K/V of several shapes, kinds and
input dtypes, the special vectors, every tie, values at rounding edges, and (slow) float32 values up to 448 through the
public quantize. On the GPU when there is one (the gpu suite runs it there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_quant_cases import KINDS, LOW_DTYPES, SHAPES, decision_rows, exhaustive_rows, \
    exhaustive_stride, random_kv, rounded, same_values, special_vectors, tie_vector
from parity.kv_quant import rounding_edges
from wise_core import kv_quant as spec
from wise_torch import kv_quant as K

pytestmark = pytest.mark.cuda   # on the GPU when there is one (the gpu suite runs it there)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_torch(x: np.ndarray) -> torch.Tensor:
    """A numpy array (bfloat16 from ml_dtypes included) as a torch tensor on DEVICE, same bits."""
    x = np.ascontiguousarray(x)
    if x.dtype == LOW_DTYPES["bfloat16"]:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16).to(DEVICE)
    return torch.from_numpy(x.copy()).to(DEVICE)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(LOW_DTYPES["bfloat16"])
    return t.numpy()


def assert_matches_spec(x: np.ndarray) -> None:
    """quantize and dequantize (every output dtype) bitwise equal to the spec's on x."""
    want_codes, want_scales = spec.quantize(x)
    codes, scales = K.quantize(to_torch(x))
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32 and codes.device == scales.device
    got_codes, got_scales = to_numpy(codes), to_numpy(scales)
    differ = np.flatnonzero(got_codes != want_codes)
    assert differ.size == 0, f"{differ.size} codes differ, first at {differ[0]}: x={x.reshape(-1)[differ[0]]!r} " \
        f"torch {got_codes.reshape(-1)[differ[0]]:#x} spec {want_codes.reshape(-1)[differ[0]]:#x}"
    assert np.array_equal(got_scales.view(np.uint32), want_scales.view(np.uint32))
    for name, dtype in TORCH_DTYPES.items():
        got = to_numpy(K.dequantize(codes, scales, dtype))
        assert same_values(got, spec.dequantize(want_codes, want_scales, name)), name


@pytest.mark.parametrize("dtype", list(LOW_DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_random_kv_matches_the_spec(kind, dtype):
    for i, shape in enumerate(SHAPES):
        assert_matches_spec(rounded(random_kv(shape, kind, seed=i), dtype))


def test_special_vectors_and_ties_match_the_spec():
    for dtype in LOW_DTYPES:
        assert_matches_spec(rounded(np.stack(list(special_vectors(16).values()))[:, None, :], dtype))
    assert_matches_spec(tie_vector()[None])
    codes, scales = K.quantize(to_torch(tie_vector()[None]))
    assert to_numpy(scales).tolist() == [1.0] and to_numpy(codes)[0, 0] == 0x7E


def test_every_rounding_decision_matches_the_spec():
    assert_matches_spec(decision_rows(ulps=40))


def test_values_at_rounding_edges_match_the_spec():
    """Values whose x * inv lies within float32 ulps of an e4m3fn midpoint: a division in place
    of the multiplication by the reciprocal (what XLA's rewrite would be the other way round)
    changes a quarter of these codes."""
    assert_matches_spec(rounding_edges(np.random.default_rng(0), 512, 64)[:, None, :])


def test_non_finite_entries_become_the_nan_code():
    x = np.array([[[np.nan, -np.nan, np.inf, -np.inf, 1.0, -2.0]]], np.float32)
    codes, scales = K.quantize(to_torch(x))
    assert to_numpy(codes).tolist() == [[[0x7F] * 4 + spec.quantize(x)[0][0, 0, 4:].tolist()]]
    back = to_numpy(K.dequantize(codes, scales, torch.float32))
    assert np.isnan(back[0, 0, :4]).all() and np.isfinite(back[0, 0, 4:]).all()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        K.quantize(torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match="must be one of"):
        K.quantize(torch.ones(2, 8, dtype=torch.float64, device=DEVICE))
    codes, scales = K.quantize(torch.ones(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="codes must be uint8"):
        K.dequantize(codes.to(torch.int8), scales, torch.float32)
    with pytest.raises(ValueError, match="scales must be float32"):
        K.dequantize(codes, scales[:1], torch.float32)
    with pytest.raises(ValueError, match="dtype must be one of"):
        K.dequantize(codes, scales, torch.float64)


@pytest.mark.slow
def test_float32_values_up_to_448_match_the_spec():
    """torch's float8 cast on the values the rule can hand it (non-negative: negatives differ in
    the sign bit, covered above), through the public quantize (vectors of scale 1): every 61st
    float32 bit pattern up to 448, or every one with WISE_KV_QUANT_EXHAUSTIVE=1
    (`kv_quant_cases.exhaustive_stride`)."""
    stride = exhaustive_stride()
    end, chunk = 0x43E00000 + 1, stride * (127 << 17)
    for start in range(0, end, chunk):
        x, want = exhaustive_rows(start, min(start + chunk, end), stride)
        codes, _ = K.quantize(to_torch(x))
        got = to_numpy(codes)
        assert np.array_equal(got, want), f"differs at {x[got != want][0]!r}"
