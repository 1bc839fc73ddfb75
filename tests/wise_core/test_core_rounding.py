"""wise_core.rounding: the one basis of every tolerance. Its bounds hold for float32 and bf16
attention computed in numpy against float64, and are tight enough to catch one dropped key."""

import ml_dtypes
import numpy as np
import pytest

from wise_core import reference as ref
from wise_core import rounding
from wise_core.presets import PRESETS

PRESET = PRESETS["test-tiny"]


def test_unit_roundoff_and_gamma():
    assert rounding.unit_roundoff("float32") == 2.0 ** -24 == rounding.unit_roundoff(np.float32)
    assert rounding.unit_roundoff("torch.bfloat16") == 2.0 ** -8 == rounding.unit_roundoff(ml_dtypes.bfloat16)
    assert rounding.gamma(64) == rounding.LAMBDA * 8 * 2.0 ** -24
    with pytest.raises(ValueError, match="no unit roundoff for dtype 'int8'"):
        rounding.unit_roundoff("int8")


def _attention_fp32(q, k, v, out_dtype=np.float32, drop=None):
    """Softmax attention in float32 (scores, exponentials, sums), output rounded to out_dtype;
    `drop`: a key index left out (a bug the bound must catch)."""
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    s = np.einsum("hd,shd->hs", q, k) * np.float32(q.shape[-1] ** -0.5)
    if drop is not None:
        s[:, drop] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    out = np.einsum("hs,shd->hd", p, v) / p.sum(-1, keepdims=True)
    return out.astype(out_dtype).astype(np.float64)


@pytest.mark.parametrize("n_keys", [1, 33, 512, 4096])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_attention_bound_holds_and_catches_a_dropped_key(n_keys, out_dtype):
    rng = np.random.default_rng(n_keys)
    q = 2.0 * rng.standard_normal((4, 64))
    k, v = rng.standard_normal((n_keys, 4, 64)), rng.standard_normal((n_keys, 4, 64))
    if out_dtype == "bfloat16":
        q, k, v = (x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in (q, k, v))
    exact, _ = ref.attention(q, k, v)
    bound = rounding.attention_bound_of(q, k, v, out_dtype=out_dtype)
    got = _attention_fp32(q, k, v, ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.float32)
    assert np.abs(got - exact).max() <= bound
    if out_dtype == "float32" and n_keys > 1:  # the bound is far below a structural error
        heaviest = int(np.argmax(np.einsum("hd,shd->s", q, k)))
        wrong = _attention_fp32(q, k, v, drop=heaviest)
        assert np.abs(wrong - exact).max() > 10 * bound


def test_selection_margin_scales_with_total_and_blocks():
    assert rounding.selection_margin(64, 2.0) == 2 * rounding.selection_margin(64, 1.0)
    assert rounding.selection_margin(4, 1.0, mass_error=1e-3) == pytest.approx(rounding.gamma(4) + 4e-3)


def test_network_bound_low_precision_is_led_by_the_output_rounding():
    fp32 = rounding.network_bound(scale=1.0, depth=16, width=256)
    bf16 = rounding.network_bound(scale=1.0, depth=16, width=256, dtype="bfloat16")
    assert fp32 == pytest.approx(rounding.LAMBDA * (64 + 4) * 2.0 ** -24)
    assert bf16 == pytest.approx(rounding.LAMBDA * (64 * 2.0 ** -24 + 4 * 2.0 ** -8))


def test_rope_error_bounds_float32_angles_and_their_cos_sin():
    """The float32 RoPE angles and cos / sin (numpy's, computed as the models do: inv_freq by a
    float32 power and division, times the position) against float64, up to position 20000:
    within `rope_error` plus the evaluation's one u (the constant part `network_bound` holds)."""
    head_dim, theta = 64, 10000.0
    inv32 = np.float32(1) / np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    inv64 = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    positions = np.arange(0, 20001, 7)
    angle32 = positions.astype(np.float32)[:, None] * inv32
    angle64 = positions[:, None] * inv64
    u = rounding.unit_roundoff("float32")
    for p, a32, a64 in zip(positions, angle32, angle64):
        bound = rounding.rope_error(p) + 2 * u
        assert np.abs(a32.astype(np.float64) - a64).max() <= bound, p
        assert np.abs(np.cos(a32).astype(np.float64) - np.cos(a64)).max() <= bound, p
        assert np.abs(np.sin(a32).astype(np.float64) - np.sin(a64)).max() <= bound, p
    assert rounding.rope_error(0) == 0 and rounding.model_bound(
        PRESET, scale=1.0, positions=0) == rounding.model_bound(PRESET, scale=1.0)
