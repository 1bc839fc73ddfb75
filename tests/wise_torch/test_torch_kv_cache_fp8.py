"""wise_torch.kv_cache with kv_cache_dtype="fp8" (issue 50): the layout (uint8 codes, a float32 scale
per (token, KV head), None scales in an unquantized cache) and the page bytes; pages that hold
bitwise `wise_core.kv_quant.quantize` of what `rope_store_kv` wrote; copies that never quantize
twice (early exit's later planes, preemption's copy_out -> copy_in) and the scrub's quantized
zeros; the decode reference and the packed prefill reference over fp8 pages equal to attention
over the dequantized K/V (every mode, mass and selection too); the paths that do not read fp8
pages refused, naming their option. CPU, float32 unless said (the mirror of
tests/wise_jax/test_jax_kv_cache_fp8.py; the engines: tests/wise_core/engine/test_engine_fp8.py)."""

import numpy as np
import pytest
import torch

from kv_quant_cases import bits
from wise_core import kv_quant as spec
from wise_core import modes as M
from wise_core.presets import PRESETS
from wise_torch import attention as A
from wise_torch.early_exit import ExitState
from wise_torch.engine.offload import copy_in, copy_out, scrub
from wise_torch.kv_cache import STORAGE, KVPlane, PagedKVCache, VarlenPrefill
from wise_torch.layers import rope_store_kv, rope_table
from wise_torch.union_decode import resolve_wise_decode

CONFIG = PRESETS["test-tiny"]      # 8 planes, 2 KV heads of head_dim 64
PLANES = CONFIG.total_ut_steps * CONFIG.num_hidden_layers


def _cache(kv_cache_dtype="fp8", num_pages=8, page_size=32, dtype=torch.float32):
    return PagedKVCache.for_model(CONFIG, num_pages=num_pages, page_size=page_size, dtype=dtype,
                                  kv_cache_dtype=kv_cache_dtype)


def test_layout_and_bytes():
    fp8, auto = _cache(), _cache("auto")
    assert fp8.quantized and not auto.quantized and (fp8.kv_cache_dtype, auto.kv_cache_dtype) == ("fp8", "auto")
    assert fp8.k.dtype == fp8.v.dtype == torch.uint8 and fp8.k.shape == auto.k.shape == (PLANES, 9, 32, 2, 64)
    for scale in (fp8.k_scale, fp8.v_scale):    # an empty page is quantize(zeros): code 0, scale 1
        assert scale.dtype == torch.float32 and scale.shape == (PLANES, 9, 32, 2) and bool((scale == 1).all())
    assert not fp8.k.any() and auto.k_scale is None and auto.v_scale is None and fp8.dtype == torch.float32
    assert fp8.storage_names() == STORAGE and auto.storage_names() == ("k", "v")
    plane = fp8.plane(3)
    assert plane.k.data_ptr() == fp8.k[3].data_ptr() and plane.scales.keys() == {"k_scale", "v_scale"}
    assert auto.plane(3).scales == {} and auto.plane(3).k_scale is None
    # a value a byte, and a float32 scale per (token, KV head) of K and of V
    assert sum(getattr(fp8, n).nbytes for n in STORAGE) == 9 * PagedKVCache.page_bytes(
        CONFIG, 32, torch.float32, kv_cache_dtype="fp8") == 9 * 2 * PLANES * 32 * 2 * (64 + 4)
    ouro = PRESETS["ouro-1.4b"]    # head_dim 128: ~1.9x the tokens of bf16, ~3.8x float32
    fp8_bytes = PagedKVCache.page_bytes(ouro, 128, torch.bfloat16, kv_cache_dtype="fp8")
    assert PagedKVCache.page_bytes(ouro, 128, torch.bfloat16) / fp8_bytes == pytest.approx(2 * 128 / 132)
    assert PagedKVCache.page_bytes(ouro, 128, torch.float32) / fp8_bytes == pytest.approx(4 * 128 / 132)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\), got 'fp16'"):
        _cache("fp16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_stores_the_quantized_k_v(dtype):
    """The roped k (in qkv's dtype) and v at their slots are bitwise quantize's codes and scales;
    q and every other slot are those of the unquantized store."""
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim = 2, 2, 64
    qkv = torch.tensor(rng.standard_normal((3, (heads + 2 * kv_heads) * head_dim)), dtype=dtype)
    qkv[:, heads * head_dim:(heads + 1) * head_dim] *= 1e3                        # a loud K head
    positions, slots = torch.tensor([0, 33, 7]), torch.tensor([5, 40, 280])
    cos_sin = rope_table(64, head_dim, 10000.0)
    fp8, auto = _cache(dtype=dtype).plane(2), _cache("auto", dtype=dtype).plane(2)
    kw = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    q = rope_store_kv(qkv, positions, cos_sin, fp8.k, fp8.v, slots, k_scale=fp8.k_scale, v_scale=fp8.v_scale, **kw)
    q_auto = rope_store_kv(qkv, positions, cos_sin, auto.k, auto.v, slots, **kw)
    assert torch.equal(q, q_auto)
    for name in ("k", "v"):
        values = getattr(auto, name).flatten(0, 1)[slots]
        codes, scales = spec.quantize(values.float().numpy())     # float32(x) is exact: the same codes
        flat_codes, flat_scales = getattr(fp8, name).flatten(0, 1), getattr(fp8, f"{name}_scale").flatten(0, 1)
        assert np.array_equal(flat_codes[slots].numpy(), codes) and np.array_equal(bits(flat_scales[slots]),
                                                                                   bits(scales))
        others = torch.ones(flat_codes.shape[0], dtype=torch.bool)
        others[slots] = False
        assert not flat_codes[others].any() and bool((flat_scales[others] == 1).all())
    with pytest.raises(ValueError, match="impl='triton' .* does not quantize K/V"):
        rope_store_kv(qkv, positions, cos_sin, fp8.k, fp8.v, slots, k_scale=fp8.k_scale, v_scale=fp8.v_scale,
                      impl="triton", **kw)
    with pytest.raises(ValueError, match=r"k_scale and v_scale must both be None or both float32\[9, 32, 2\]"):
        rope_store_kv(qkv, positions, cos_sin, fp8.k, fp8.v, slots, k_scale=fp8.k_scale, **kw)
    with pytest.raises(ValueError, match="k_plane must be a uint8 .fp8 codes"):
        rope_store_kv(qkv, positions, cos_sin, auto.k, auto.v, slots, k_scale=fp8.k_scale, v_scale=fp8.v_scale,
                      **kw)


def test_copies_keep_codes_and_scales_as_they_are():
    """Early exit's later planes take the exit loop's codes and scales; copy_out -> copy_in moves
    every array bitwise (a wrong tuple is refused); the scrub leaves quantized zeros."""
    rng = np.random.default_rng(1)
    cache = _cache()
    for name in STORAGE:
        x = getattr(cache, name)
        x.copy_(torch.tensor(rng.integers(0, 256, x.shape), dtype=torch.uint8) if x.dtype == torch.uint8
                else torch.tensor(rng.uniform(0.1, 2, x.shape), dtype=torch.float32))
    before = {name: getattr(cache, name).clone() for name in STORAGE}
    exits = ExitState(2, 4, 0.5, keep_kv=True, device="cpu")
    exits.exited = torch.tensor([True, False])
    slots = torch.tensor([3 * 32 + 4, 5 * 32 + 1])
    exits.store_kv(1, cache.plane(6), cache.plane(2), slots)
    for name in STORAGE:
        flat, was = getattr(cache, name)[6].flatten(0, 1), before[name][2].flatten(0, 1)
        assert torch.equal(flat[slots[0]], was[slots[0]]), name                        # the exited row: copied
        assert torch.equal(flat[slots[1]], before[name][6].flatten(0, 1)[slots[1]]), name   # the other: kept
    stored = copy_out(cache, [1, 3])
    assert len(stored) == 4 and stored[2].shape == (PLANES, 2, 32, 2) and stored[0].device.type == "cpu"
    copy_in(cache, [5, 6], stored)
    for name in STORAGE:
        x = getattr(cache, name)
        assert np.array_equal(bits(x[:, [5, 6]]), bits(x[:, [1, 3]])), name
    with pytest.raises(ValueError, match="the pages hold 2 arrays; this fp8 cache stores"):
        copy_in(cache, [5, 6], stored[:2])
    scrub(cache, [1, 6])
    assert not cache.k[:, [1, 6]].any() and not cache.v[:, [1, 6]].any()
    assert bool((cache.k_scale[:, [1, 6]] == 1).all()) and bool((cache.v_scale[:, [1, 6]] == 1).all())
    assert all(torch.equal(getattr(cache, n)[:, 4], before[n][:, 4]) for n in STORAGE)   # untouched


def _pages(rng, num_pages=6, page_size=32, kv_heads=2, head_dim=64):
    return (rng.standard_normal((num_pages, page_size, kv_heads, head_dim))
            * rng.uniform(0.1, 10, (num_pages, page_size, kv_heads, 1))).astype(np.float32)


def _fp8_pages(rng, dtype):
    """(codes, scales) of K and of V as torch tensors, and their dequantized values in `dtype`."""
    k, v = _pages(rng), _pages(rng)
    quantized = [tuple(torch.from_numpy(a) for a in spec.quantize(x)) for x in (k, v)]
    values = [torch.from_numpy(spec.dequantize(c.numpy(), s.numpy(), "float32")).to(dtype) for c, s in quantized]
    return quantized, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reference_on_fp8_pages_is_attention_over_the_dequantized_k_v(dtype):
    """Every mode in one call; output, support' and block mass bitwise those over dequantize(codes,
    scales, q's dtype); kernel "auto" runs the reference for them."""
    rng = np.random.default_rng(3)
    ((k_codes, k_scale), (v_codes, v_scale)), (k_deq, v_deq) = _fp8_pages(rng, dtype)
    batch, heads = 4, 4
    q = torch.tensor(rng.standard_normal((batch, heads, 64)), dtype=dtype)
    table = torch.tensor([[0, 3, 5], [1, 2, 4], [5, 0, 0], [2, 4, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([70, 96, 20, 41], dtype=torch.int32)
    modes = torch.tensor([M.DENSE, M.DISCOVER, M.DISCOVER_UNION, M.SPARSE], dtype=torch.int32)
    support = torch.tensor(rng.random((batch, heads, 3)) < 0.5)
    support[:, :, 0] = True
    kw = dict(block_size=32, eta=0.8, return_mass=True)
    want = A.decode_attention(q, k_deq, v_deq, table, seq_lens, modes, support.clone(), kernel="reference", **kw)
    got = A.decode_attention(q, k_codes, v_codes, table, seq_lens, modes, support.clone(), kernel="auto",
                             k_scale=k_scale, v_scale=v_scale, **kw)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert want[0].float().std() > 0.1       # not a degenerate case


def test_prefill_references_on_fp8_pages_are_attention_over_the_dequantized_k_v():
    """The packed varlen reference and the grouped SDPA path's gather (`KVPlane.gather`) read an
    fp8 plane as its dequantized values, bitwise."""
    rng = np.random.default_rng(5)
    ((k_codes, k_scale), (v_codes, v_scale)), (k_deq, v_deq) = _fp8_pages(rng, torch.float32)
    varlen = VarlenPrefill.build([(20, 30, [4, 1]), (0, 9, [2])], page_size=32, scratch_page=5)
    q = torch.tensor(rng.standard_normal((39, 4, 64)), dtype=torch.float32)
    want = A.prefill_attention_varlen_reference(q, k_deq, v_deq, varlen)
    got = A.prefill_attention_varlen_reference(q, k_codes, v_codes, varlen, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(got, want) and want.std() > 0.1
    pages = torch.tensor([[4, 1], [2, 0]])
    gathered = KVPlane(k_codes, v_codes, k_scale, v_scale).gather(pages, torch.bfloat16)
    for x, deq in zip(gathered, (k_deq, v_deq)):
        assert x.dtype == torch.bfloat16 and torch.equal(x, deq[pages].to(torch.bfloat16))


def test_paths_that_do_not_read_fp8_pages_are_refused():
    with pytest.raises(ValueError, match=r"kernel='triton' .* does not read kv_cache_dtype='fp8' pages yet"):
        A.resolve_kernel("triton", "cuda", 64, "fp8")
    assert A.resolve_kernel("auto", "cuda", 64, "fp8") is A.decode_attention_reference   # Triton otherwise
    assert A.auto_kernel("cuda", 64) == "triton" and A.auto_kernel("cuda", 64, "fp8") == "reference"
    assert A.attention_plan("auto", "cuda", torch.bfloat16, 64, "fp8") == A.AttentionPlan("reference", "sdpa")
    for backend in ("triton", "fa4"):
        with pytest.raises(ValueError, match=rf"attention_backend='{backend}' does not read kv_cache_dtype='fp8'"):
            A.attention_plan(backend, "cuda", torch.bfloat16, 64, "fp8")
    with pytest.raises(ValueError, match=r"prefill='fa4' .* does not read kv_cache_dtype='fp8'"):
        A.prefill_function("fa4", "cuda", torch.bfloat16, "fp8")
    with pytest.raises(ValueError, match=r"dense_decode='fa4' .* does not read kv_cache_dtype='fp8'"):
        A.dense_decode_function("fa4", "cuda", torch.bfloat16, "fp8")
    for arm in ("fa4-union", "reference-union"):
        with pytest.raises(ValueError, match=rf"wise_decode='{arm}' .* does not read kv_cache_dtype='fp8'"):
            resolve_wise_decode(arm, "cuda", torch.bfloat16, None, "fp8")
    rng = np.random.default_rng(4)
    codes, scale = (torch.from_numpy(a) for a in spec.quantize(_pages(rng)))
    args = (torch.ones(1, 2, 64), codes, codes, torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.ones(1, 2, 1, dtype=bool))
    with pytest.raises(ValueError, match="kernel='triton'"):
        A.decode_attention(*args, block_size=32, eta=0.9, kernel="triton", k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError, match="k_scale and v_scale must be given together"):
        A.decode_attention_reference(*args, block_size=32, eta=0.9, k_scale=scale)
    with pytest.raises(ValueError, match="q, k_pages and v_pages must share one dtype"):   # codes without scales
        A.decode_attention(*args, block_size=32, eta=0.9, kernel="reference")
    with pytest.raises(ValueError, match=r"fp8 pages k_pages / k_scale: scales must be float32\[6, 32, 2\]"):
        A.decode_attention(*args, block_size=32, eta=0.9, kernel="reference", k_scale=scale[:, :1], v_scale=scale)
