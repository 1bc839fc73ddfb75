"""What "within rounding" means, once, for every tolerance the tests and parity hold results to.

Basis. `u` is the unit roundoff of a dtype (round to nearest: float32 2**-24, bfloat16 2**-8,
float16 2**-11): one rounding has relative error <= u. A sum of n terms computed in a dtype is
within `gamma(n) * sum |terms|` of exact, with gamma(n) = LAMBDA * sqrt(n) * u: the probabilistic
bound of Higham and Mary (SIAM J. Sci. Comput. 41(5), 2019, Thm. 2.4) for rounding errors that
are independent and of mean zero, which holds with probability >= 1 - 2n exp(-LAMBDA**2 / 2)
(LAMBDA = 8: 1 - 2.6e-14 n). Worst-case bounds (n u instead of sqrt(n) u) are sure but grow
looser than a structural bug's effect on long rows, so every bound here uses this one basis:
unit roundoff, reduction length, LAMBDA. Values rounded once to a dtype (an output in bf16,
probabilities fed to a bf16 dot) add their u, deterministic.

Each function names the computation it bounds; callers write the call next to the assertion.
"""

from __future__ import annotations

import math

import numpy as np

LAMBDA = 8.0
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float64": 2.0 ** -53}


def unit_roundoff(dtype) -> float:
    """u of a dtype given by name or as a numpy / torch / JAX dtype."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:  # a torch dtype
            name = str(dtype).removeprefix("torch.")
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff for dtype {dtype!r} (known: {', '.join(UNIT_ROUNDOFF)})")
    return UNIT_ROUNDOFF[name]


def gamma(n: int, dtype="float32") -> float:
    """Relative error of a sum of n terms in `dtype` (times the sum of their magnitudes)."""
    return LAMBDA * math.sqrt(max(n, 1)) * unit_roundoff(dtype)


def score_error(qk_max: float, head_dim: int) -> float:
    """Absolute error of a float32 score scale * q.k: a dot of head_dim products, then the scale
    and the subtraction of the running max (three terms more), each on values <= qk_max
    (scale * |q| * |k|, an upper bound of |score| by Cauchy-Schwarz)."""
    return gamma(head_dim + 3) * qk_max


def probability_error(qk_max: float, head_dim: int, n_keys: int) -> float:
    """Relative error of each softmax term exp(s - m) / L over n_keys keys in float32: the score
    error (an absolute error e in s is a relative error ~e in exp(s)), the exponential and the
    online-softmax rescales and sums (<= 2 n_keys + 4 roundings per term)."""
    return score_error(qk_max, head_dim) + gamma(2 * n_keys + 4)


def attention_bound(*, v_max: float, qk_max: float, head_dim: int, n_keys: int, out_dtype="float32",
                    p_dtype=None) -> float:
    """|out - exact| of one (row, head) of softmax attention computed in float32: numerator and
    normaliser each carry the probability error, plus the rounding of probabilities to `p_dtype`
    (a bf16 tensor-core dot; None: kept float32) and of the output to `out_dtype`. v_max: the
    largest |v| attended."""
    p_rounding = 0.0 if p_dtype is None else unit_roundoff(p_dtype)
    return v_max * (2 * probability_error(qk_max, head_dim, n_keys) + p_rounding + unit_roundoff(out_dtype))


def mass_bound(*, qk_max: float, head_dim: int, n_keys: int) -> float:
    """|block mass - exact| of a block's summed probabilities (<= 1): the numerator's and the
    normaliser's relative errors."""
    return 2 * probability_error(qk_max, head_dim, n_keys)


def selection_margin(n_blocks: int, total: float, mass_error: float = 0.0) -> float:
    """How far from eta * total the mass ranked before a block may lie and still be decided
    either way: running sums of n_blocks masses in float32 (any order), each mass off by up to
    `mass_error` (0 when both sides select from the same masses)."""
    return gamma(n_blocks) * total + n_blocks * mass_error


def network_bound(*, scale: float, depth: int, width: int, dtype="float32") -> float:
    """|logit difference| of two implementations of the model that round at different points:
    each of `depth` (layers * loops) sublayers accumulates float32 reductions of up to `width`
    terms and rounds its output once to the activation dtype, and these
    roundings, of independent sign, add up over the depth * width float32 ones and the depth
    output ones. A model of error growth on the basis above, not a worst-case bound (the
    network's gain is taken as 1: norms re-scale every sublayer). scale: the largest |logit|
    (or |log-prob|) compared."""
    roundings = math.sqrt(depth * width) * unit_roundoff("float32") + math.sqrt(depth) * unit_roundoff(dtype)
    return LAMBDA * roundings * scale


def _scales(q, k, v, scale):
    """(largest |v|, largest scale * |q_h| * |k_i|, head_dim) of one row: q [heads, head_dim],
    k, v [n_keys, kv_heads, head_dim] (numpy)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    head_dim = q.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    qk = scale * np.linalg.norm(q, axis=-1).max() * np.linalg.norm(k, axis=-1).max()
    return float(np.abs(v).max()), float(qk), head_dim


def attention_bound_of(q, k, v, *, out_dtype="float32", p_dtype=None, n_keys=None, scale=None) -> float:
    """`attention_bound` of one row from its arrays: q [heads, head_dim], the keys and values
    it attends k, v [n, kv_heads, head_dim] (n_keys: how many of them, default all)."""
    v_max, qk_max, head_dim = _scales(q, k, v, scale)
    return attention_bound(v_max=v_max, qk_max=qk_max, head_dim=head_dim,
                           n_keys=len(k) if n_keys is None else n_keys, out_dtype=out_dtype, p_dtype=p_dtype)


def mass_bound_of(q, k, *, scale=None) -> float:
    """`mass_bound` of one dense row from its arrays: q [heads, head_dim], k [n, kv_heads, head_dim]."""
    _, qk_max, head_dim = _scales(q, k, k, scale)
    return mass_bound(qk_max=qk_max, head_dim=head_dim, n_keys=len(k))


def rope_error(max_position: int) -> float:
    """Absolute error of a float32 RoPE angle p * inv_freq at positions |p| <= max_position, the
    part that grows with the position: inv_freq (<= 1) is a float32 power (up to two ulps, 4 u)
    and division (u), the product rounds once more (u), so the angle is off by up to 6 u p; cos
    and sin pass it on as an absolute error (their own rounding is one u, as any sublayer's)."""
    return 6 * abs(max_position) * unit_roundoff("float32")


def model_bound(config, *, scale: float, keys: int = 0, dtype="float32", positions: int = 0) -> float:
    """`network_bound` of a ModelConfig: depth layers * loops (Huginn: prelude + core block *
    total_ut_steps + coda layers), width its longest reduction (hidden size, MLP width, Huginn's
    adapter over 2 * hidden, or the `keys` attended). positions: the largest RoPE position of
    either run, when it matters (two runs at other positions): each sublayer's rotated q and k
    are then off by `rope_error(positions)` (relative), taken as two more roundings of that size
    a sublayer, of independent sign over the depth."""
    if config.architecture == "huginn":
        depth = (config.n_layers_in_prelude + config.n_layers_in_recurrent_block * config.total_ut_steps
                 + config.n_layers_in_coda)
        width = max(2 * config.hidden_size, config.intermediate_size, keys)
    else:
        depth = config.num_hidden_layers * config.total_ut_steps
        width = max(config.hidden_size, config.intermediate_size, keys)
    rope = LAMBDA * math.sqrt(depth) * 2 * rope_error(positions) * scale
    return network_bound(scale=scale, depth=depth, width=width, dtype=dtype) + rope


def model_difference(got, want, config, *, keys: int = 0, dtype="float32", positions: int = 0
                     ) -> tuple[float, float]:
    """(max |got - want|, `model_bound` at scale max |want|) of two runs' logits or log-probs
    (numpy arrays or CPU tensors): a test asserts the first <= the second."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = model_bound(config, scale=float(np.abs(want).max()), keys=keys, dtype=dtype, positions=positions)
    return float(np.abs(got - want).max()), bound
