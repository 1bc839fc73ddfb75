"""One decode-attention contract (docs/DESIGN.md), validated the same way by all four
implementations: the torch and JAX references, Triton (interpreted on CPU) and Pallas
(interpret=True on CPU). Bad values raise a ValueError naming the argument (JAX under jit:
when the result is read); NaN inputs give NaN outputs; an unvalidated SPARSE head that selects
no causal block gives NaN. Tiny shapes: 3 rows, 2 heads, head_dim 16 or 32, pages of 32 keys."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from wise_core import modes as M
from wise_jax import attention as jax_attention
from wise_jax.kernels import pallas_decode
from wise_torch import attention as torch_attention
from wise_torch.kernels import triton_decode

pytestmark = pytest.mark.cuda   # on the GPU when there is one (the gpu suite runs it there)

BLOCK, PAGE, ETA = 32, 32, 0.9
IMPLS = ("torch-reference", "torch-triton", "jax-reference", "jax-pallas")


def problem(heads=2, kv_heads=2, dim=16, seq_lens=(1, 40, 96), seed=0) -> dict[str, np.ndarray]:
    """A valid call: pages of 32 keys scattered over a pool of 3 * max_pages + 1 pages."""
    rng = np.random.default_rng(seed)
    batch, max_pages = len(seq_lens), 3
    num_pages = batch * max_pages + 1
    table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    support = rng.random((batch, heads, max_pages * PAGE // BLOCK)) < 0.5
    support[:, :, 0] = True  # every SPARSE head selects a causal block
    return dict(q=rng.standard_normal((batch, heads, dim)).astype(np.float32),
                k_pages=rng.standard_normal((num_pages, PAGE, kv_heads, dim)).astype(np.float32),
                v_pages=rng.standard_normal((num_pages, PAGE, kv_heads, dim)).astype(np.float32),
                page_table=table, seq_lens=np.asarray(seq_lens, np.int32),
                modes=np.array([M.DISCOVER, M.SPARSE, M.DISCOVER_UNION], np.int32),
                support=support)


def _jax_fn(impl: str):
    return jax_attention.decode_attention_reference if impl == "jax-reference" else functools.partial(
        pallas_decode.decode_attention, interpret=jax.default_backend() != "gpu")


def call(impl: str, args: dict, *, validate: bool = True, jit: bool = False):
    """(out, support', mass) as numpy, from numpy arguments (dtypes kept as given)."""
    settings = dict(block_size=BLOCK, eta=ETA, return_mass=True, validate=validate)
    if impl.startswith("torch"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        fn = torch_attention.decode_attention_reference if impl == "torch-reference" else triton_decode.decode_attention
        tensors = {name: torch.from_numpy(np.array(x)).to(device) for name, x in args.items()}
        out, support, mass = fn(**tensors, **settings)
        return out.float().cpu().numpy(), support.cpu().numpy(), mass.cpu().numpy()
    fn = functools.partial(_jax_fn(impl), **settings)
    if jit:
        fn = jax.jit(fn)
    out, support, mass = fn(**{name: jnp.asarray(x) for name, x in args.items()})
    return np.asarray(out, np.float32), np.asarray(support), np.asarray(mass)


def _with(args: dict, **change) -> dict:
    out = {name: np.array(x) for name, x in args.items()}
    for name, fix in change.items():
        out[name] = fix(out[name]) if callable(fix) else fix
    return out


def _set(index, value):
    def fix(x):
        x[index] = value
        return x
    return fix


BAD_VALUES = {  # name: (change, message the ValueError must match)
    "page -1 in a used entry": (dict(page_table=_set((2, 1), -1)), r"page_table: rows \[2\] use pages \[-1\]"),
    "page past the pool": (dict(page_table=_set((1, 0), 10)), r"page_table: rows \[1\] use pages \[10\] outside the pool \[0, 10\)"),
    "seq_len past the page table": (dict(seq_lens=_set(2, 97)), r"seq_lens must be in \[1, 96\].*rows \[2\] hold \[97\]"),
    "seq_len zero": (dict(seq_lens=_set(0, 0)), r"seq_lens must be in \[1, 96\].*rows \[0\] hold \[0\]"),
    "seq_len negative": (dict(seq_lens=_set(1, -3)), r"rows \[1\] hold \[-3\]"),
    "unknown mode": (dict(modes=_set(0, 7)), r"modes must be one of .*rows \[0\] hold \[7\]"),
    "SPARSE head without a causal block": (
        dict(support=_set((1, 1, slice(0, 2)), False)), r"support: SPARSE rows \[1\] select no causal block.*\(1, 1\)"),
}

BAD_TYPES = {
    "int32 support": (dict(support=lambda s: s.astype(np.int32)), "support must be bool"),
    "int64 page_table": (dict(page_table=lambda t: t.astype(np.int64)), "page_table must be int32"),
    "int64 seq_lens": (dict(seq_lens=lambda s: s.astype(np.int64)), "seq_lens must be int32"),
    "float modes": (dict(modes=lambda m: m.astype(np.float32)), "modes must be int32"),
    "float16 k with float32 q": (dict(k_pages=lambda k: k.astype(np.float16)), "share one dtype"),
    "support too short": (dict(support=lambda s: s[:, :, :2]), "support must be bool"),
}


INT64 = ("int64 page_table", "int64 seq_lens")  # JAX without x64 has no int64 arrays


@pytest.mark.parametrize("impl, name", [(impl, name) for name in list(BAD_VALUES) + list(BAD_TYPES)
                                        for impl in IMPLS if not (name in INT64 and impl.startswith("jax"))])
def test_bad_input_is_a_named_error(impl, name):
    change, message = {**BAD_VALUES, **BAD_TYPES}[name]
    with pytest.raises(ValueError, match=message):
        call(impl, _with(problem(), **change))


@pytest.mark.parametrize("impl", ["jax-reference", "jax-pallas"])
@pytest.mark.parametrize("name", ["page -1 in a used entry", "seq_len zero", "SPARSE head without a causal block"])
def test_bad_values_are_reported_under_jit(impl, name):
    """Traced values are checked by a host callback before the attention runs."""
    change, message = BAD_VALUES[name]
    with pytest.raises(Exception, match=message):
        call(impl, _with(problem(), **change), jit=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_validate_false_skips_only_the_value_checks(impl):
    args = problem()
    checked, unchecked = call(impl, args), call(impl, args, validate=False)
    for a, b in zip(checked, unchecked):
        np.testing.assert_array_equal(a, b)  # bitwise: the same computation
    with pytest.raises(ValueError, match="support must be bool"):
        call(impl, _with(args, support=lambda s: s.astype(np.int32)), validate=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_stays_nan_and_support_stays_causal(impl):
    """NaN in one row's q: that row's output is NaN; its DISCOVER support holds causal blocks
    only; the other rows are bitwise what they are without the NaN."""
    args = problem(seq_lens=(40, 40, 96))
    args["modes"] = np.array([M.DISCOVER, M.DENSE, M.SPARSE], np.int32)
    clean = call(impl, args)
    out, support, mass = call(impl, _with(args, q=_set((0, 1, 3), np.nan)))
    assert np.isnan(out[0, 1]).all()
    assert np.isnan(mass[0, 1, :2]).all()  # the causal blocks' mass
    causal = np.arange(support.shape[-1]) * BLOCK < 40
    assert not (support[0] & ~causal).any(), "a DISCOVER row with NaN mass selected a non-causal block"
    np.testing.assert_array_equal(out[0, 0], clean[0][0, 0])
    np.testing.assert_array_equal(out[1:], clean[0][1:])


@pytest.mark.parametrize("impl", IMPLS)
def test_unvalidated_empty_sparse_head_is_nan(impl):
    """docs/DESIGN.md: a SPARSE head that selects no causal block is outside the contract;
    unvalidated, every implementation returns NaN for it (the softmax of no keys)."""
    args = _with(problem(), support=_set((1, 1, slice(0, 2)), False))
    out, support, _ = call(impl, args, validate=False)
    assert np.isnan(out[1, 1]).all()
    assert np.isfinite(out[1, 0]).all() and np.isfinite(out[[0, 2]]).all()
    np.testing.assert_array_equal(support[1], args["support"][1])


def test_triton_without_cuda_or_interpreter_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="the Triton kernel needs a CUDA device or TRITON_INTERPRET=1"):
        torch_attention.resolve_kernel("triton", "cpu")
