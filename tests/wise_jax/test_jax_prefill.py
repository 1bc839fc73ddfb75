"""wise_jax.prefill_attention: the chunked (flash-style) causal attention against the full-matrix
reference for right-padded rows of mixed lengths, MHA and GQA; its temporary memory grows
linearly with the sequence; the dispatcher's choice on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wise_core import rounding
from wise_jax import prefill_attention as pa


def _qkv(rng, batch, seq, heads, kv_heads, dim, dtype=jnp.float32):
    q = rng.standard_normal((batch, seq, heads, dim)) * 2      # peaked enough that the max matters
    k = rng.standard_normal((batch, seq, kv_heads, dim))
    v = rng.standard_normal((batch, seq, kv_heads, dim))
    return (jnp.asarray(x, dtype) for x in (q, k, v))


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
def test_chunked_matches_reference_for_mixed_lengths(heads, kv_heads):
    """Rows right-padded from lengths 300, 97 and 1 with random padding: every position below a
    row's length matches the reference. Chunks of 128 over 300 positions: three chunks, the last
    one padded inside the function. fp32, both within `rounding.attention_bound` of exact (up to
    300 keys), so within twice it of each other."""
    rng = np.random.default_rng(heads)
    q, k, v = _qkv(rng, 3, 300, heads, kv_heads, 32)
    lengths = [300, 97, 1]
    ref = np.asarray(jax.jit(pa.causal_attention_reference)(q, k, v))
    out = np.asarray(jax.jit(lambda q, k, v: pa.causal_attention_chunked(q, k, v, chunk=128))(q, k, v))
    assert out.shape == ref.shape and out.dtype == np.float32
    qk_max = 32 ** -0.5 * float(jnp.linalg.norm(q, axis=-1).max() * jnp.linalg.norm(k, axis=-1).max())
    bound = 2 * rounding.attention_bound(v_max=float(jnp.abs(v).max()), qk_max=qk_max, head_dim=32, n_keys=300)
    for b, n in enumerate(lengths):
        assert np.abs(out[b, :n] - ref[b, :n]).max() <= bound
    # Padding after a row's length never changes the positions before it.
    padded = jnp.where(jnp.arange(300)[None, :, None, None] < 97, q, 1e3)
    again = np.asarray(jax.jit(lambda q, k, v: pa.causal_attention_chunked(q, k, v, chunk=128))(padded, k, v))
    np.testing.assert_array_equal(again[1, :97], out[1, :97])


def test_auto_is_chunked_on_cpu_and_names_are_checked():
    assert pa.resolve_implementation("auto", jnp.bfloat16, 128) == "chunked"     # CPU: no cuDNN
    assert pa.resolve_implementation("reference", jnp.float32, 64) == "reference"
    with pytest.raises(ValueError, match="unknown prefill attention 'flash'"):
        pa.resolve_implementation("flash", jnp.float32, 64)
    q, k, v = _qkv(np.random.default_rng(0), 1, 40, 4, 3, 16)
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        pa.causal_attention(q, k[:, :, :3], v[:, :, :3])


def _temp_bytes(fn, seq):
    shape = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.float32)
    return jax.jit(fn).lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes


def test_chunked_memory_grows_linearly():
    """Compiled temporaries at 2K and 8K positions: x4 (linear) for the chunked version, while
    the reference's [seq, seq] scores alone are 16x larger at 8K (2 heads x 8K x 8K x 4 bytes)."""
    small, large = (_temp_bytes(pa.causal_attention_chunked, n) for n in (2048, 8192))
    assert large <= 4.5 * small, (small, large)
    assert large < 2 * 8192 * 8192 * 4 / 20, large
