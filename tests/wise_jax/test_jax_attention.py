"""wise_jax.attention: the selection rule and every mode of the reference decode attention,
against wise_core.reference (numpy, float64). Tolerances: wise_core.rounding's bounds of each row."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wise_core import modes as M
from wise_core import reference as R
from wise_core import rounding
from wise_jax import attention as A

BLOCK = 32


def test_select_blocks_matches_numpy_spec():
    rng = np.random.default_rng(0)
    mass = rng.random((64, 12)).astype(np.float32) ** 4
    mass[:8, 5:] = 0.0                                   # non-causal blocks
    mass[8:16] = np.round(mass[8:16] * 4) / 4            # many ties
    mass[16, :] = 0.25                                   # all tied
    for eta in (0.5, 0.9, 0.95, 1.0):
        got = np.asarray(jax.jit(A.select_blocks, static_argnums=1)(jnp.asarray(mass), eta))
        np.testing.assert_array_equal(got, R.select_blocks(mass, eta), err_msg=f"eta={eta}")
    assert np.asarray(A.select_blocks(jnp.asarray(mass), 0.95)).any(-1).all()


def _paged(rng, seq_lens, page_size, kv_heads, dim, n_pages):
    """Random keys/values scattered over shuffled pages; unused slots hold large garbage."""
    batch = len(seq_lens)
    max_pages = n_pages // batch
    k = (rng.standard_normal((n_pages, page_size, kv_heads, dim)) * 50).astype(np.float32)
    v = (rng.standard_normal((n_pages, page_size, kv_heads, dim)) * 50).astype(np.float32)
    table = rng.permutation(n_pages).reshape(batch, max_pages).astype(np.int32)
    for b, n in enumerate(seq_lens):  # valid keys are normal(0, 1); the rest stays garbage
        keys = k[table[b]].reshape(-1, kv_heads, dim)
        vals = v[table[b]].reshape(-1, kv_heads, dim)
        keys[:n] = rng.standard_normal((n, kv_heads, dim))
        vals[:n] = rng.standard_normal((n, kv_heads, dim))
        k[table[b]] = keys.reshape(max_pages, page_size, kv_heads, dim)
        v[table[b]] = vals.reshape(max_pages, page_size, kv_heads, dim)
    return k, v, table


def _contiguous(pages, table, b, n):
    return pages[table[b]].reshape(-1, *pages.shape[2:])[:n]


@functools.partial(jax.jit, static_argnames=("block_size", "eta", "return_mass"))
def _reference(*args, block_size, eta, return_mass):
    return A.decode_attention_reference(*args, block_size=block_size, eta=eta, return_mass=return_mass)


@pytest.mark.parametrize("heads,kv_heads,page_size", [(4, 4, 64), (4, 2, 32)])
def test_decode_attention_modes(heads, kv_heads, page_size):
    rng = np.random.default_rng(1)
    dim, eta = 16, 0.9
    seq_lens = [1, 45, 64, 130, 97, 128, 77, 20]
    batch = len(seq_lens)
    k, v, table = _paged(rng, seq_lens, page_size, kv_heads, dim, n_pages=batch * (192 // page_size))
    n_blocks = table.shape[1] * page_size // BLOCK
    q = rng.standard_normal((batch, heads, dim)).astype(np.float32) * 2
    support = rng.random((batch, heads, n_blocks)) < 0.4
    support[:, :, 0] = True                               # every SPARSE row attends something
    modes = np.array([M.DENSE, M.DISCOVER, M.DISCOVER_UNION, M.SPARSE] * 2, np.int32)
    args = [jnp.asarray(x) for x in (q, k, v, table, np.array(seq_lens, np.int32), modes, support)]
    out, new_support, mass = map(np.asarray, _reference(*args, block_size=BLOCK, eta=eta, return_mass=True))

    for b, n in enumerate(seq_lens):
        kb, vb = _contiguous(k, table, b, n), _contiguous(v, table, b, n)
        sparse = modes[b] == M.SPARSE
        ref_out, ref_mass = R.attention(q[b], kb, vb, block_size=BLOCK,
                                        support=support[b] if sparse else None)
        assert np.abs(out[b] - ref_out).max() <= rounding.attention_bound_of(q[b], kb, vb)  # fp32 vs float64
        causal = R.causal_blocks(n, BLOCK, n_blocks)
        assert np.abs(mass[b][:, causal] - ref_mass[:, :causal.sum()]).max() <= rounding.mass_bound_of(q[b], kb)
        assert not mass[b][:, ~causal].any()
        selected = R.select_blocks(mass[b], eta)          # the rule, on the same masses
        expected = {M.DENSE: support[b], M.SPARSE: support[b], M.DISCOVER: selected,
                    M.DISCOVER_UNION: support[b] | selected}[int(modes[b])]
        np.testing.assert_array_equal(new_support[b], expected, err_msg=f"row {b} mode {modes[b]}")

    # DISCOVER rows, and SPARSE rows selecting every causal block, are bitwise DENSE.
    all_causal = np.stack([np.broadcast_to(R.causal_blocks(n, BLOCK, n_blocks), (heads, n_blocks))
                           for n in seq_lens])
    for mode, sup in ((M.DISCOVER, support), (M.DISCOVER_UNION, support), (M.SPARSE, all_causal)):
        args[5], args[6] = jnp.full((batch,), mode, jnp.int32), jnp.asarray(sup)
        other = np.asarray(_reference(*args, block_size=BLOCK, eta=eta, return_mass=False)[0])
        args[5] = jnp.full((batch,), M.DENSE, jnp.int32)
        dense = np.asarray(_reference(*args, block_size=BLOCK, eta=eta, return_mass=False)[0])
        assert np.array_equal(other, dense), M.NAMES[mode]


def test_bfloat16_output_dtype_and_accuracy():
    rng = np.random.default_rng(2)
    k, v, table = _paged(rng, [50, 33], 32, 2, 16, n_pages=4)
    q = rng.standard_normal((2, 2, 16)).astype(np.float32)
    args = [jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16),
            jnp.asarray(table), jnp.asarray([50, 33], jnp.int32), jnp.zeros((2,), jnp.int32),
            jnp.zeros((2, 2, 2), bool)]
    out, _ = A.decode_attention_reference(*args, block_size=BLOCK, eta=0.95)
    assert out.dtype == jnp.bfloat16
    ref, _ = R.attention(np.asarray(args[0][0], np.float32), _contiguous(np.asarray(args[1], np.float32), table, 0, 50),
                         _contiguous(np.asarray(args[2], np.float32), table, 0, 50), block_size=BLOCK)
    q0, k0 = np.asarray(args[0][0], np.float32), _contiguous(np.asarray(args[1], np.float32), table, 0, 50)
    v0 = _contiguous(np.asarray(args[2], np.float32), table, 0, 50)
    bound = rounding.attention_bound_of(q0, k0, v0, out_dtype="bfloat16")  # the output rounded to bf16
    assert np.abs(np.asarray(out[0], np.float32) - ref).max() <= bound


def test_shape_errors_and_kernel_dispatch(monkeypatch):
    q = jnp.zeros((2, 4, 16))
    k = jnp.zeros((4, 32, 2, 16))
    table, lens, modes = jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32), jnp.zeros((2,), jnp.int32)
    support = jnp.zeros((2, 4, 2), bool)
    with pytest.raises(ValueError, match=r"support must be bool\[2, 4, 2\]"):
        A.decode_attention_reference(q, k, k, table, lens, modes, support[:, :, :1], block_size=BLOCK, eta=0.9)
    with pytest.raises(ValueError, match="not a multiple of 4 KV heads|query heads are not a multiple"):
        A.decode_attention_reference(q[:, :3], k, k, table, lens, modes, support, block_size=BLOCK, eta=0.9)
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        A.decode_attention_reference(q, k, k, table, lens, modes, support, block_size=64, eta=0.9)
    with pytest.raises(ValueError, match=r"block_size must be a positive power of two \(an int\), got 0"):
        A.decode_attention_reference(q, k, k, table, lens, modes, support, block_size=0, eta=0.9)
    with pytest.raises(ValueError, match=r"eta must be a number in \(0, 1\], got 1.5"):
        A.decode_attention_reference(q, k, k, table, lens, modes, support, block_size=BLOCK, eta=1.5)
    ref = A.decode_attention(q, k, k, table, lens, modes, support, block_size=BLOCK, eta=0.9, kernel="reference")
    assert ref[0].shape == (2, 4, 16)
    with pytest.raises(ValueError, match="unknown JAX decode-attention kernel 'triton'"):
        A.decode_attention(q, k, k, table, lens, modes, support, block_size=BLOCK, eta=0.9, kernel="triton")
    assert A.resolve_kernel("auto") == ("pallas" if jax.default_backend() == "gpu" else "reference")
    with monkeypatch.context() as gpu:  # "auto" on a GPU: the Pallas kernel for head dims it takes
        gpu.setattr(jax, "default_backend", lambda: "gpu")
        assert [A.resolve_kernel("auto", d) for d in (128, 96, 48, 8, None)] == ["pallas"] * 5
        assert [A.resolve_kernel("auto", d) for d in (40, 24)] == ["reference"] * 2
        assert A.attention_impl("auto", 40) is A.decode_attention_reference
    monkeypatch.setitem(sys.modules, "wise_jax.kernels.pallas_decode", None)   # import fails
    with pytest.raises(ImportError, match="kernel='pallas' needs wise_jax.kernels.pallas_decode"):
        A.decode_attention(q, k, k, table, lens, modes, support, block_size=BLOCK, eta=0.9, kernel="pallas")
