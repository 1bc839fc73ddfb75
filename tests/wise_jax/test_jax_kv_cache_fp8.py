"""wise_jax.kv_cache with kv_cache_dtype="fp8" (issue 50): the layout (uint8 codes, a float32 scale
per (token, KV head), None scales and the unchanged pytree of an unquantized cache), pages that
hold bitwise `wise_jax.kv_quant.quantize` of what was written (write_token, insert, prefill's
chunks), copies of entries that never quantize twice (read_token -> write_token, read_pages ->
write_pages), the decode reference over fp8 pages equal to attention over the dequantized K/V
(every mode, mass and selection too), and the kernels that read them. CPU, float32 unless said."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from kv_quant_cases import bits
from wise_core import kv_quant as spec
from wise_core import modes as M
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_jax import attention as A
from wise_jax import kv_cache as kvc
from wise_jax import kv_quant
from wise_jax.chunked_prefill import prefill_chunks
from wise_jax.kernels import choice

CONFIG = PRESETS["test-tiny"]      # 8 planes, 2 KV heads of head_dim 64
PLANES = CONFIG.total_ut_steps * CONFIG.num_hidden_layers


def _cache(kv_cache_dtype="fp8", batch=3, max_pages=4, num_pages=8, page_size=32, dtype=jnp.float32):
    return kvc.create(CONFIG, batch=batch, max_pages=max_pages, num_pages=num_pages, page_size=page_size,
                      dtype=dtype, kv_cache_dtype=kv_cache_dtype)


def test_layout_bytes_and_pytree():
    fp8, auto = _cache(), _cache("auto")
    assert fp8.quantized and not auto.quantized and (fp8.kv_cache_dtype, auto.kv_cache_dtype) == ("fp8", "auto")
    assert fp8.k.dtype == fp8.v.dtype == jnp.uint8 and fp8.k.shape == auto.k.shape == (PLANES, 9, 32, 2, 64)
    for scale in (fp8.k_scale, fp8.v_scale):    # an empty page is quantize(zeros): code 0, scale 1
        assert scale.dtype == jnp.float32 and scale.shape == (PLANES, 9, 32, 2) and np.all(np.asarray(scale) == 1)
    assert not np.asarray(fp8.k).any() and auto.k_scale is None and auto.v_scale is None
    assert (fp8.num_pages, fp8.scratch_page, fp8.page_size, fp8.capacity) == (8, 8, 32, 128)
    # an unquantized cache keeps its 7 leaves (None scales are no leaves); an fp8 one has 9
    assert len(jax.tree.leaves(auto)) == 7 and len(jax.tree.leaves(fp8)) == 9
    again = jax.jit(lambda c: c)(fp8)
    assert again.quantized and jax.tree.structure(again) == jax.tree.structure(fp8)
    # a value a byte, and a float32 scale per (token, KV head) of K and of V
    assert kvc.page_bytes(CONFIG, 32, jnp.float32, kv_cache_dtype="fp8") == 2 * PLANES * 32 * 2 * (64 + 4)
    assert kvc.page_bytes(CONFIG, 32, jnp.float32) == 2 * PLANES * 32 * 2 * 64 * 4
    ouro = PRESETS["ouro-1.4b"]    # head_dim 128: ~1.9x the tokens of bf16, ~3.8x float32
    fp8_bytes = kvc.page_bytes(ouro, 128, jnp.bfloat16, kv_cache_dtype="fp8")
    assert kvc.page_bytes(ouro, 128, jnp.bfloat16) / fp8_bytes == pytest.approx(2 * 128 / 132)
    assert kvc.page_bytes(ouro, 128, jnp.float32) / fp8_bytes == pytest.approx(4 * 128 / 132)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\), got 'fp16'"):
        _cache("fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not implemented for Huginn"):
        kvc.create(PRESETS["test-tiny-huginn"], batch=1, max_pages=1, num_pages=2, page_size=32,
                   planes=3 + 3 * 4, kv_cache_dtype="fp8")
    cache = _cache()
    with pytest.raises(ValueError, match=r"cache.k_scale must be float32\[8, 9, 32, 2\]"):
        wise_jax.checks.cache(dataclasses.replace(cache, k_scale=cache.k_scale[..., 0]), CONFIG)
    with pytest.raises(ValueError, match="must both be None"):
        wise_jax.checks.cache(dataclasses.replace(cache, v_scale=None), CONFIG)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_token_stores_the_quantized_token_and_copies_entries_as_they_are(dtype):
    rng = np.random.default_rng(0)
    cache = kvc.reserve(_cache(dtype=dtype), jnp.array([33, 4, 0], jnp.int32))
    k = jnp.asarray(rng.standard_normal((3, 2, 64)) * [[1], [1e3]], dtype)         # unequal heads
    v = jnp.asarray(rng.standard_normal((3, 2, 64)), dtype)
    rows = jnp.array([True, True, False])
    before = jax.tree.map(np.asarray, cache)
    cache = jax.jit(kvc.write_token)(cache, 5, k, v, rows)
    table = np.asarray(cache.page_table)
    for x, codes, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        want_codes, want_scales = spec.quantize(np.asarray(x))
        for b, pos in enumerate([32, 3]):
            page, offset = table[b, pos // 32], pos % 32
            assert np.array_equal(np.asarray(codes[5, page, offset]), want_codes[b])
            assert np.array_equal(bits(scales[5, page, offset]), bits(want_scales[b]))
    for name in kvc.STORAGE:   # rows 0 and 1 in their pages of plane 5; row 2 on the scratch page
        changed = np.argwhere(np.any(np.asarray(getattr(cache, name)) != getattr(before, name),
                                     axis=tuple(range(2, getattr(cache, name).ndim))))
        assert {tuple(c) for c in changed.tolist()} <= {(5, table[0, 1]), (5, table[1, 0]), (5, 8)}, name
    # read_token gives the entries, (codes, scales); writing them to another plane copies them
    (k_codes, k_scales), (v_codes, v_scales) = kvc.read_token(cache, 5, rows)
    assert np.array_equal(np.asarray(k_codes[:2]), spec.quantize(np.asarray(k))[0][:2])
    moved = jax.jit(kvc.write_token)(cache, 6, (k_codes, k_scales), (v_codes, v_scales), rows)
    for name in kvc.STORAGE:
        x = np.asarray(getattr(moved, name))
        assert np.array_equal(bits(x[6, table[0, 1], 0]), bits(x[5, table[0, 1], 0])), name
    # attention reads them dequantized to the model's dtype: wise_core.kv_quant.dequantize
    k_pages, _, shifted = kvc.plane_pages(cache, 5)
    k_scale, _ = kvc.plane_scales(cache)
    got = kv_quant.dequantize(k_pages[shifted[0, 1], 0], k_scale[shifted[0, 1], 0], dtype)
    want = spec.dequantize(*spec.quantize(np.asarray(k[0])), jnp.dtype(dtype).name)
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_insert_and_page_copies_are_bitwise():
    rng = np.random.default_rng(1)
    cache = _cache()
    k = jnp.asarray(rng.standard_normal((PLANES, 64, 2, 64)), jnp.float32)          # 2 pages of one request
    cache = jax.jit(kvc.insert)(cache, k, -k, jnp.int32(40), jnp.int32(0))
    pages = np.asarray(cache.page_table)[0, :2]
    want_codes, want_scales = spec.quantize(np.asarray(k).reshape(PLANES, 2, 32, 2, 64))
    assert np.array_equal(np.asarray(cache.k)[:, pages], want_codes)
    assert np.array_equal(bits(np.asarray(cache.k_scale)[:, pages]), bits(want_scales))
    assert np.array_equal(np.asarray(cache.v)[:, pages], spec.quantize(-np.asarray(k).reshape(want_codes.shape))[0])
    # preemption's offload and restore: read_pages' storage written to other pages as it is
    stored = jax.jit(kvc.read_pages)(cache, jnp.asarray(pages))
    assert len(stored) == 4 and stored[2].shape == (PLANES, 2, 32, 2)
    moved = jax.jit(kvc.write_pages)(cache, jnp.array([5, 6], jnp.int32), stored)
    for name in kvc.STORAGE:
        x = np.asarray(getattr(moved, name))
        assert np.array_equal(bits(x[:, [5, 6]]), bits(x[:, pages])), name
    with pytest.raises(ValueError, match="the pages hold 2 arrays; this fp8 cache stores"):
        kvc.write_pages(cache, jnp.array([5, 6], jnp.int32), stored[:2])


def test_prefill_chunks_write_the_quantized_k_v_and_attend_what_the_pages_hold():
    """Every K/V a prefill writes (recorded at `kv_cache.store`) is in the pages as its quantize,
    bitwise; a prompt prefilled in two chunks (the second attending the first over the pages)
    writes the values of the one-chunk prefill (which attends its own keys through
    `stored_values`), up to float32 rounding of the attention."""
    params = wise_jax.from_checkpoint_tensors(CONFIG, random_tensors(CONFIG, seed=5, std=0.08))
    tokens = np.random.default_rng(2).integers(0, CONFIG.vocab_size, 50).astype(np.int32)
    table = jnp.array([[0, 1]], jnp.int32)
    written = []
    real_store = kvc.store

    def recording(cache, index, k, v):
        if not isinstance(k, tuple):
            jax.debug.callback(lambda *xs: written.append([np.asarray(x) for x in xs]), index[0], k, v)
        return real_store(cache, index, k, v)

    def run(chunks, attention):
        cache = _cache(batch=1, max_pages=2, num_pages=2)
        for start, end in chunks:
            padded = np.zeros((1, 64), np.int32)
            padded[0, :end - start] = tokens[start:end]
            _, cache = jax.jit(lambda *xs: prefill_chunks(params, CONFIG, *xs, attention=attention))(
                cache, jnp.asarray(padded), jnp.array([start], jnp.int32), jnp.array([end - start], jnp.int32), table)
        return jax.tree.map(np.asarray, cache)

    kvc.store = recording
    try:
        whole = run([(0, 50)], "reference")
    finally:
        kvc.store = real_store
    assert len(written) == PLANES
    for plane, k, v in written:
        for x, codes, scales in ((k, whole.k, whole.k_scale), (v, whole.v, whole.v_scale)):
            want_codes, want_scales = spec.quantize(x[0, :50])
            assert np.array_equal(codes[int(plane), :2].reshape(64, 2, 64)[:50], want_codes), int(plane)
            assert np.array_equal(bits(scales[int(plane), :2].reshape(64, 2)[:50]), bits(want_scales))
    two = run([(0, 20), (20, 50)], None)
    values = [spec.dequantize(c[:, :2].reshape(PLANES, 64, 2, 64)[:, :50], s[:, :2].reshape(PLANES, 64, 2)[:, :50],
                              "float32") for c, s in ((whole.k, whole.k_scale), (two.k, two.k_scale))]
    # The two attend in other orders: float32 rounding moves a scale by an ulp or so, and where it
    # lands a value on the other side of an e4m3fn rounding decision its code moves by one (and
    # later planes that read it a little); almost every code is the same.
    assert np.mean(whole.k[:, :2] == two.k[:, :2]) > 0.99 and np.mean(whole.v[:, :2] == two.v[:, :2]) > 0.99
    np.testing.assert_allclose(two.k_scale[:, :2], whole.k_scale[:, :2], rtol=1e-3)
    amax = np.abs(values[0]).max(-1, keepdims=True)
    assert np.all(np.abs(values[1] - values[0]) <= amax / 8)


def _pages(rng, num_pages=6, page_size=32, kv_heads=2, head_dim=64):
    return (rng.standard_normal((num_pages, page_size, kv_heads, head_dim))
            * rng.uniform(0.1, 10, (num_pages, page_size, kv_heads, 1))).astype(np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_reference_on_fp8_pages_is_attention_over_the_dequantized_k_v(dtype):
    """Every mode in one call; output, support' and block mass bitwise those over dequantize(codes,
    scales, q's dtype), eagerly and under jit."""
    rng = np.random.default_rng(3)
    k, v = _pages(rng), _pages(rng)
    (k_codes, k_scale), (v_codes, v_scale) = spec.quantize(k), spec.quantize(v)
    k_deq, v_deq = (jnp.asarray(spec.dequantize(c, s, jnp.dtype(dtype).name)) for c, s in
                    ((k_codes, k_scale), (v_codes, v_scale)))
    batch, heads = 4, 4
    q = jnp.asarray(rng.standard_normal((batch, heads, 64)), dtype)
    table = jnp.array([[0, 3, 5], [1, 2, 4], [5, 0, 0], [2, 4, 1]], jnp.int32)
    seq_lens = jnp.array([70, 96, 20, 41], jnp.int32)
    modes = jnp.array([M.DENSE, M.DISCOVER, M.DISCOVER_UNION, M.SPARSE], jnp.int32)
    support = jnp.asarray(rng.random((batch, heads, 3)) < 0.5).at[:, :, 0].set(True)
    kw = dict(block_size=32, eta=0.8, return_mass=True)
    scales = dict(k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))
    jitted = jax.jit(A.decode_attention, static_argnames=("block_size", "eta", "return_mass", "kernel"))
    for fn in (A.decode_attention, jitted):      # XLA fuses a program otherwise than eager ops: each its own
        want = fn(q, k_deq, v_deq, table, seq_lens, modes, support, kernel="reference", **kw)
        got = fn(q, jnp.asarray(k_codes), jnp.asarray(v_codes), table, seq_lens, modes, support, kernel="auto",
                 **kw, **scales)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert np.asarray(want[0], np.float32).std() > 0.1       # not a degenerate case


def test_kernels_of_fp8_pages_and_refusals(monkeypatch):
    """'pallas' runs the Pallas kernel (it reads fp8 pages: tests/wise_jax/test_pallas_decode.py),
    never the Mosaic one, on any GPU; fp8 pages without both scales are refused."""
    assert A.resolve_kernel("pallas", 64, "fp8") == "pallas"
    assert A.resolve_kernel("reference", 64, "fp8") == "reference"
    monkeypatch.setattr(choice, "uses_mosaic", lambda head_dim, dtype: True)     # a Hopper GPU
    monkeypatch.setattr(choice.pallas_decode, "decode_attention", lambda *a, **kw: "pallas_decode")
    assert choice.decode_attention(*([None] * 7), k_scale=1, v_scale=1) == "pallas_decode"
    rng = np.random.default_rng(4)
    (codes, scale) = spec.quantize(_pages(rng))
    args = (jnp.ones((1, 2, 64)), jnp.asarray(codes), jnp.asarray(codes), jnp.zeros((1, 1), jnp.int32),
            jnp.array([5], jnp.int32), jnp.zeros((1,), jnp.int32), jnp.ones((1, 2, 1), bool))
    with pytest.raises(ValueError, match="k_scale and v_scale must be given together"):
        A.decode_attention(*args, block_size=32, eta=0.9, kernel="reference", k_scale=jnp.asarray(scale))
    with pytest.raises(ValueError, match="q, k_pages and v_pages must share one dtype"):   # codes without scales
        A.decode_attention(*args, block_size=32, eta=0.9, kernel="reference")
    with pytest.raises(ValueError, match=r"fp8 pages k_pages / k_scale: scales must be float32\[6, 32, 2\]"):
        A.decode_attention(*args, block_size=32, eta=0.9, kernel="reference", k_scale=jnp.asarray(scale)[:, :1],
                           v_scale=jnp.asarray(scale))


def test_auto_runs_the_reference_for_fp8_on_every_backend(monkeypatch):
    """'auto' on a GPU would pick the Pallas kernel; for fp8 pages it picks the reference."""
    monkeypatch.setattr(A.jax, "default_backend", lambda: "gpu")
    assert A.resolve_kernel("auto", 64, "fp8") == "reference"
    assert A.attention_impl("auto", 64, "fp8") is A.decode_attention_reference
