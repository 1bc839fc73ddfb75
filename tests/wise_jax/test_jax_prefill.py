"""wise_jax.prefill_attention: the chunked (flash-style) causal attention against the full-matrix
reference for right-padded rows of mixed lengths, MHA and GQA; its temporary memory grows
linearly with the sequence; the dispatcher's choice on CPU; packed segments (segment_ids)."""

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


def test_segments_attend_only_their_own_earlier_keys():
    """Packed rows (chunks of 8 over 40 positions): row 0 holds segments of 5, 20 and 15 tokens
    (the last one's queries find none of their keys in the first chunk), row 1 two interleaved
    ids. Chunked and reference attention with segment_ids equal each segment run alone, within
    twice `rounding.attention_bound` (both within it of exact; fp32, up to 40 keys). The gradient
    of a segment's outputs is finite and exactly zero on every other segment's keys and values."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 2, 40, 4, 2, 16)
    segments = jnp.asarray([[0] * 5 + [1] * 20 + [2] * 15, [0, 1] * 20], jnp.int32)
    chunked = jax.jit(lambda q, k, v, s: pa.causal_attention_chunked(q, k, v, chunk=8, segment_ids=s))
    qk_max = 16 ** -0.5 * float(jnp.linalg.norm(q, axis=-1).max() * jnp.linalg.norm(k, axis=-1).max())
    bound = 2 * rounding.attention_bound(v_max=float(jnp.abs(v).max()), qk_max=qk_max, head_dim=16, n_keys=40)
    outs = (np.asarray(chunked(q, k, v, segments)),
            np.asarray(pa.causal_attention(q, k, v, implementation="reference", segment_ids=segments)))
    for b in range(2):
        for segment in np.unique(np.asarray(segments[b])):
            where = np.flatnonzero(np.asarray(segments[b]) == segment)
            alone = np.asarray(pa.causal_attention_reference(*(x[b:b + 1, where] for x in (q, k, v))))[0]
            for out in outs:
                assert np.abs(out[b, where] - alone).max() <= bound, (b, segment)

    def loss(q, k, v):
        return (chunked(q, k, v, segments)[0, 25:] ** 2).sum()          # segment 2 of row 0
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        g = np.asarray(g)
        assert np.isfinite(g).all() and np.abs(g[0, 25:]).max() > 0
        assert not g[0, :25].any() and not g[1].any()


def test_segment_ids_are_checked_and_cudnn_takes_none():
    q, k, v = _qkv(np.random.default_rng(0), 2, 16, 2, 2, 16)
    with pytest.raises(ValueError, match=r"segment_ids must be an integer array \[batch, seq\] = \[2, 16\] \(q's\), "
                                         r"got int32\[1, 16\]"):
        pa.causal_attention(q, k, v, segment_ids=jnp.zeros((1, 16), jnp.int32))
    with pytest.raises(ValueError, match=r"segment_ids must be .*got float32\[2, 16\]"):
        pa.causal_attention_chunked(q, k, v, segment_ids=jnp.zeros((2, 16), jnp.float32))
    with pytest.raises(ValueError, match="prefill attention 'cudnn' takes no segment_ids"):
        pa.causal_attention(q, k, v, implementation="cudnn", segment_ids=jnp.zeros((2, 16), jnp.int32))
