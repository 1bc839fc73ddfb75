"""Causal self-attention over whole sequences (prefill and the full forward), never materialising
the [seq, seq] scores.

Implementations (`causal_attention(..., implementation=)`):
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash attention.
  Chosen on a GPU for bf16 / fp16 with head_dim a multiple of 8 up to 128 (cuDNN's limits; it
  has no fp32 kernel). It is NVIDIA's tuned Hopper kernel, reached through jax.nn with its VJP,
  and already carries training here (benchmarks/train/train_builtin.py). A Pallas flash prefill would
  go through the deprecated Triton lowering, or Mosaic GPU, which cannot be compiled or checked
  on a machine without a GPU; neither would beat cuDNN on the H200.
- "chunked": plain jnp, flash-style. Queries and keys in chunks of `CHUNK` positions; each
  query chunk runs an online softmax (running max, sum, float32 accumulator) over the key chunks
  at or before it (later chunks are skipped by `lax.cond`; the diagonal chunk is masked).
  Temporary memory is one [batch, heads, chunk, chunk] score tile plus the accumulators: linear
  in the sequence. Used on CPU and for fp32 on a GPU. Differentiable (static scans and conds).
- "reference": the full [seq, seq] float32 softmax in jnp, the checked reference of the tests
  (and the plain-XLA fallback of benchmarks/train/train_builtin.py).

Shapes: q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim] with heads a
multiple of kv_heads (query head h reads KV head h // (heads // kv_heads)); scale head_dim**-0.5;
softmax in float32; output in q's dtype. Right padding needs no mask: with causal masking a
position < length never sees a later (padding) key, and rows at padding positions are discarded
by the caller.

Packed sequences: `segment_ids` int[batch, seq] (None: one segment) restricts each query to the
earlier keys of its own segment (causal AND equal segment id), so several sequences share a row
(a padding run is one more segment). "chunked" and "reference" take them (a query chunk's tile
masks the keys of other segments; a key chunk holding none of its segment adds nothing); "auto"
then picks "chunked" on a GPU too, as `jax.nn.dot_product_attention` takes segments to cuDNN only
as a [seq, seq] mask, and "cudnn" with segment_ids is an error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

IMPLEMENTATIONS = ("auto", "cudnn", "chunked", "reference")
CHUNK = 256


def resolve_implementation(implementation: str, dtype, head_dim: int) -> str:
    """'auto' -> 'cudnn' on a GPU for bf16 / fp16 and head_dim % 8 == 0, <= 128; else 'chunked'."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown prefill attention {implementation!r}; choose one of {IMPLEMENTATIONS}")
    if implementation != "auto":
        return implementation
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if on_gpu and half and head_dim % 8 == 0 and head_dim <= 128 else "chunked"


def _check(q, k, v) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, "
                         f"head_dim], got q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {q.shape} does not fit k {k.shape}: batch, seq and head_dim must match "
                         f"and heads must be a multiple of kv_heads")


def _check_segments(q, segment_ids) -> None:
    if segment_ids is None:
        return
    shape = getattr(segment_ids, "shape", None)
    dtype = getattr(segment_ids, "dtype", None)
    if shape is None or dtype is None or not jnp.issubdtype(dtype, jnp.integer) or tuple(shape) != q.shape[:2]:
        got = f"{jnp.dtype(dtype).name}{list(shape)}" if shape is not None and dtype is not None else type(
            segment_ids).__name__
        raise ValueError(f"segment_ids must be an integer array [batch, seq] = {list(q.shape[:2])} (q's), got {got}")


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "auto",
                     segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention (module docstring) -> [batch, seq, heads, head_dim]; segment_ids
    int[batch, seq] or None: packed sequences (module docstring)."""
    _check(q, k, v)
    _check_segments(q, segment_ids)
    name = resolve_implementation(implementation, q.dtype, q.shape[-1])
    if segment_ids is not None and name == "cudnn":
        if implementation == "cudnn":
            raise ValueError("prefill attention 'cudnn' takes no segment_ids (jax.nn.dot_product_attention passes "
                             "them to cuDNN only as a [seq, seq] mask); use 'chunked' or 'auto'")
        name = "chunked"
    if name == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if name == "chunked":
        return causal_attention_chunked(q, k, v, segment_ids=segment_ids)
    return causal_attention_reference(q, k, v, segment_ids=segment_ids)


def causal_attention_chunked(q: jax.Array, k: jax.Array, v: jax.Array, *, chunk: int = CHUNK,
                             segment_ids: jax.Array | None = None) -> jax.Array:
    """Flash-style causal attention in jnp (module docstring); memory linear in seq. Chunks are
    laid out contiguously first ([chunks, batch, kv_heads, positions (x group), head_dim]) so each
    tile is a plain batched matmul. segment_ids: each tile also masks other segments' keys; a
    query's running max stays -inf over chunks of none of its keys, and is shifted by 0 there
    (its exponentials are 0, not NaN)."""
    _check(q, k, v)
    _check_segments(q, segment_ids)
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    size = min(chunk, seq)
    n = -(-seq // size)
    pad = n * size - seq   # trailing positions: causal, so no real query sees them
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    if segment_ids is not None:   # [n, batch, size]: each chunk's ids; queries' repeated over the group
        seg_k = segment_ids.reshape(batch, n, size).transpose(1, 0, 2)
        seg_q = jnp.repeat(seg_k, group, axis=2)
    rows = size * group                                                 # query rows: (position, group)
    qc = q.reshape(batch, n, size, kv_heads, group, dim).transpose(1, 0, 3, 2, 4, 5).reshape(
        n, batch, kv_heads, rows, dim)
    kc, vc = (x.reshape(batch, n, size, kv_heads, dim).transpose(1, 0, 3, 2, 4) for x in (k, v))
    scale = dim ** -0.5
    query_pos = jnp.repeat(jnp.arange(size, dtype=jnp.int32), group)
    key_pos = jnp.arange(size, dtype=jnp.int32)

    def query_chunk(_, i):
        qi = qc[i]                                                      # [batch, kv, rows, dim]

        def key_chunk(carry, j):
            def update(carry):
                m, l, acc = carry
                s = jnp.einsum("bkqd,bksd->bkqs", qi, kc[j], preferred_element_type=jnp.float32) * scale
                visible = (j * size + key_pos)[None, :] <= (i * size + query_pos)[:, None]
                if segment_ids is not None:                             # [batch, 1, rows, size]
                    visible = visible & (seg_q[i][:, None, :, None] == seg_k[j][:, None, None, :])
                s = jnp.where(visible, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))
                shift = m_new
                if segment_ids is not None:     # no key of the query's segment yet: exp(-inf - 0) = 0
                    shift = jnp.where(m_new == -jnp.inf, jnp.float32(0), m_new)
                p = jnp.exp(s - shift[..., None])
                correction = jnp.exp(m - shift)
                pv = jnp.einsum("bkqs,bksd->bkqd", p.astype(vc.dtype), vc[j], preferred_element_type=jnp.float32)
                return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv
            return lax.cond(j <= i, update, lambda c: c, carry), None

        init = (jnp.full((batch, kv_heads, rows), -jnp.inf, jnp.float32),
                jnp.zeros((batch, kv_heads, rows), jnp.float32),
                jnp.zeros((batch, kv_heads, rows, dim), jnp.float32))
        (_, l, acc), _ = lax.scan(key_chunk, init, jnp.arange(n))
        return None, (acc / l[..., None]).astype(q.dtype)

    _, out = lax.scan(query_chunk, None, jnp.arange(n))                # [n, batch, kv, rows, dim]
    out = out.reshape(n, batch, kv_heads, size, group, dim).transpose(1, 0, 3, 2, 4, 5)
    return out.reshape(batch, n * size, heads, dim)[:, :seq]


def causal_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *,
                               segment_ids: jax.Array | None = None) -> jax.Array:
    """The full-matrix float32 softmax (module docstring): memory quadratic in seq. segment_ids:
    the mask is also [batch, seq, seq] (equal segment ids)."""
    _check(q, k, v)
    _check_segments(q, segment_ids)
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(batch, seq, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * dim ** -0.5
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    if segment_ids is not None:                                          # [batch, 1, 1, seq, seq]
        causal = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v)
    return out.reshape(batch, seq, heads, dim)
