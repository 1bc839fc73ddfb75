"""The Pallas paged decode kernel (wise_jax.kernels.pallas_decode) in interpret mode on CPU.

Small shapes (a few rows, 2-4 heads, 6-8 blocks). References: wise_core.reference (numpy,
float64) and wise_jax.attention.decode_attention_reference (jnp). Tolerances are
`wise_core.rounding`'s bounds of each row (attention output, block mass, selection margin);
against the jnp reference, twice the output bound (both round). Bitwise claims compare the raw
bits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import held_slots
from wise_core import kv_quant
from wise_core import modes as M
from wise_core import reference as ref
from wise_core import rounding, split_plan
from wise_jax.kernels import mosaic_decode, pallas_decode
from wise_jax.kernels.pallas_decode import KernelConfig, config_for, decode_attention

BLOCK = 32
ETA = 0.95
SPLIT = KernelConfig(tile_n=64, split_keys=128)  # 2 blocks a step, 4 a split, two launches
FUSED = KernelConfig(tile_n=32, split_keys=64, fused_finish=True)  # 2 blocks a split; the last finishes
DOTS = KernelConfig(tile_n=32, split_keys=256, min_splits=3, dots=True)  # 6 blocks: 3 splits of 2


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def make_case(seed, *, page_size, heads, kv_heads, head_dim, dtype, max_pages, seq_lens):
    """A random paged cache whose pages are scattered over a shuffled pool."""
    rng = np.random.default_rng(seed)
    batch = len(seq_lens)
    num_pages = batch * max_pages + 3
    shape = (num_pages, page_size, kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(3.0 * rng.standard_normal((batch, heads, head_dim)), dtype)  # peaked softmax
    page_table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
    n_blocks = max_pages * page_size // BLOCK
    support = rng.random((batch, heads, n_blocks)) < 0.4
    support[:, :, 0] = True  # a sparse row must select a causal block
    return dict(q=q, k=k, v=v, page_table=jnp.asarray(page_table, jnp.int32),
                seq_lens=jnp.asarray(seq_lens, jnp.int32), support=jnp.asarray(support))


def _row_keys(case, b):
    """Row b's q [heads, head_dim] and keys, values [seq_len, kv_heads, head_dim], float64."""
    k, v = (np.asarray(case[name].astype(jnp.float32), np.float64) for name in ("k", "v"))
    pages = np.asarray(case["page_table"][b])
    n = int(case["seq_lens"][b])
    q = np.asarray(case["q"][b].astype(jnp.float32), np.float64)
    return q, k[pages].reshape(-1, *k.shape[2:])[:n], v[pages].reshape(-1, *v.shape[2:])[:n]


def row_reference(case, b, support=None):
    """(out float64 [heads, head_dim], mass [heads, n_blocks]) of row b from wise_core.reference."""
    q, keys, values = _row_keys(case, b)
    n_causal = ref.num_blocks(len(keys), BLOCK)
    out, mass = ref.attention(q, keys, values, block_size=BLOCK,
                              support=None if support is None else support[:, :n_causal])
    padded = np.zeros((mass.shape[0], case["support"].shape[-1]))
    padded[:, :n_causal] = mass
    return out, padded


def out_bound(case, b, config=None):
    """`rounding.attention_bound_of` row b, dense (bounds its sparse subsets too): float32
    probabilities (rounded to the case's dtype for a 16-bit dot when config.dots), the output
    rounded to the case's dtype."""
    dtype = jnp.dtype(case["q"].dtype).name
    p_dtype = dtype if getattr(config, "dots", False) and dtype != "float32" else None
    return rounding.attention_bound_of(*_row_keys(case, b), out_dtype=dtype, p_dtype=p_dtype)


def mass_bound(case, b):
    q, keys, _ = _row_keys(case, b)
    return rounding.mass_bound_of(q, keys)


def assert_within(got, want, bound, what=""):
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), f"{what}: max |diff| {err.max():.3g} > bound {bound:.3g}"


def stale(case):
    """The case with NaN in every K/V slot that is not one of a row's keys (`cases.held_slots`)."""
    k, v = np.array(case["k"].astype(jnp.float32)), np.array(case["v"].astype(jnp.float32))
    held = held_slots(case["page_table"], case["seq_lens"], *k.shape[:2])
    k[~held], v[~held] = np.nan, np.nan
    return dict(case, k=jnp.asarray(k, case["k"].dtype), v=jnp.asarray(v, case["v"].dtype))


def check_stale_nan_unread(spec, *, impl=decode_attention, **kw):
    """NaN in the slots past every row's keys changes no output, mass or support, bitwise: the
    rows of every mode read no value past their keys (0 x NaN would be NaN)."""
    case = make_case(2, **spec)
    modes = [(M.SPARSE, M.DISCOVER, M.DENSE, M.DISCOVER_UNION)[b % 4] for b in range(len(spec["seq_lens"]))]
    for got, want in zip(run(stale(case), modes, impl=impl, **kw), run(case, modes, impl=impl, **kw)):
        assert np.array_equal(bits(got), bits(want))


def run(case, modes, support=None, *, impl=decode_attention, **kw):
    """impl (default this kernel's decode_attention) on the case, with return_mass."""
    kw.setdefault("config", SPLIT)
    return impl(case["q"], case["k"], case["v"], case["page_table"], case["seq_lens"],
                jnp.asarray(modes, jnp.int32), case["support"] if support is None else support,
                block_size=BLOCK, eta=kw.pop("eta", ETA), return_mass=True, **kw)


COMBOS = {
    "page32-mha-d64-f32": dict(page_size=32, heads=2, kv_heads=2, head_dim=64, dtype=jnp.float32,
                               max_pages=6, seq_lens=[192, 150, 70, 33]),
    "page64-gqa-d128-bf16": dict(page_size=64, heads=4, kv_heads=2, head_dim=128, dtype=jnp.bfloat16,
                                 max_pages=3, seq_lens=[130, 192, 97, 64]),
    "page128-gqa-d64-bf16": dict(page_size=128, heads=2, kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                                 max_pages=2, seq_lens=[256, 200, 129, 31]),
    # head_dim a multiple of 16, not a power of two: 128 / 64 lanes, the padded ones masked
    "page32-mha-d96-f32": dict(page_size=32, heads=2, kv_heads=2, head_dim=96, dtype=jnp.float32,
                               max_pages=6, seq_lens=[192, 150, 70, 33]),  # huginn-0125's head_dim, MHA
    "page64-gqa-d48-bf16": dict(page_size=64, heads=4, kv_heads=2, head_dim=48, dtype=jnp.bfloat16,
                                max_pages=3, seq_lens=[130, 192, 97, 64]),
}


def assert_selection(got, mass, held, *, exact):
    """got == select_blocks(mass, ETA) | held, per head. exact=False allows what the spec does
    (wise_core.reference): a block may differ only where the mass ranked before it lies within
    `rounding.selection_margin` of the threshold."""
    expected = ref.select_blocks(mass, ETA) | held
    if exact:
        assert np.array_equal(got, expected)
        return
    for head in np.flatnonzero((got != expected).any(-1)):
        m = mass[head].astype(np.float64)
        order = np.argsort(-mass[head], kind="stable")
        before = np.concatenate([[0.0], np.cumsum(m[order])[:-1]])
        margin = rounding.selection_margin(len(m), m.sum())
        for rank in np.flatnonzero(got[head][order] != expected[head][order]):
            assert abs(before[rank] - ETA * m.sum()) <= margin, (head, order[rank])


def check_modes(spec, *, config, exact=True, impl=decode_attention):
    """Rows cycle DISCOVER, DISCOVER_UNION, SPARSE with every causal block, SPARSE at random.

    Dense = reference; discover/union bitwise dense; sparse-all bitwise dense; sparse = masked
    reference; selection = select_blocks on the kernel's mass (see assert_selection); union =
    OR; other rows' support unchanged."""
    case = make_case(1, **spec)
    batch, heads, n_blocks = case["support"].shape
    roles = np.arange(batch) % 4
    causal = np.stack([ref.causal_blocks(int(n), BLOCK, n_blocks) for n in case["seq_lens"]])
    support = np.asarray(case["support"]).copy()
    support[roles == 2] = causal[roles == 2][:, None, :]
    support = jnp.asarray(support)
    modes = np.array([M.DISCOVER, M.DISCOVER_UNION, M.SPARSE, M.SPARSE])[roles]

    dense_out, dense_support, _ = run(case, [M.DENSE] * batch, support, config=config, impl=impl)
    out, new_support, mass = run(case, modes, support, config=config, impl=impl)
    assert out.dtype == spec["dtype"] and out.shape == case["q"].shape
    assert np.array_equal(np.asarray(dense_support), np.asarray(support))
    mass, held = np.asarray(mass), np.asarray(support)
    for b in range(batch):
        expected, expected_mass = row_reference(case, b)
        bound = out_bound(case, b, config)
        assert_within(np.asarray(dense_out[b].astype(jnp.float32)), expected, bound, f"dense row {b}")
        if roles[b] < 3:  # discover, union, sparse-all
            assert np.array_equal(bits(out[b]), bits(dense_out[b])), f"row {b}"
        else:
            sparse_expected, _ = row_reference(case, b, held[b])
            assert_within(np.asarray(out[b].astype(jnp.float32)), sparse_expected, bound, f"sparse row {b}")
        if roles[b] < 2:
            assert_within(mass[b], expected_mass, mass_bound(case, b), f"mass row {b}")
            assert_selection(np.asarray(new_support[b]), mass[b], held[b] & (roles[b] == 1),
                             exact=exact)
            selected = ref.select_blocks(mass[b], ETA)
            assert not np.array_equal(selected, np.broadcast_to(causal[b], selected.shape)), \
                f"row {b} should select a strict subset of its causal blocks"
        else:
            assert np.array_equal(np.asarray(new_support[b]), held[b])


@pytest.mark.parametrize("name", list(COMBOS))
def test_modes_against_references_and_dense(name):
    spec = COMBOS[name]
    check_modes(spec, config=SPLIT)


def test_modes_with_dots_and_min_splits():
    """Tensor-core dots (q padded to 16 rows) and rows split into up to 3 programs of whole
    tiles: the same equivalences (bitwise ones too)."""
    check_modes(COMBOS["page64-gqa-d128-bf16"], config=DOTS)


def test_padded_head_dim_with_dots_and_fused_finish():
    """head_dim 96 in bf16 (Huginn's attention, MHA) on tensor-core dots over 128 lanes: the
    modes' equivalences; the fused finish gives bitwise the separate finish's outputs."""
    spec = dict(COMBOS["page32-mha-d96-f32"], dtype=jnp.bfloat16)
    check_modes(spec, config=DOTS)
    case = make_case(9, **spec)
    modes = [M.DISCOVER, M.SPARSE, M.DISCOVER_UNION, M.DENSE]
    separate = run(case, modes, config=dataclasses.replace(DOTS, fused_finish=False))
    fused = run(case, modes, config=dataclasses.replace(DOTS, fused_finish=True))
    assert separate[0].shape == case["q"].shape
    for a, b in zip(separate, fused):
        assert np.array_equal(bits(a), bits(b))
    assert config_for(96, jnp.bfloat16) == config_for(128, jnp.bfloat16)  # the 128-lane tiles' entry
    assert not mosaic_decode.supports(96, jnp.bfloat16)  # kernels.choice runs this kernel for 96
    assert not mosaic_decode.supports(192, jnp.bfloat16) and mosaic_decode.supports(128, jnp.bfloat16)


@pytest.mark.parametrize("n", [1, 8, 256])
def test_sorted_selection_is_select_blocks(n):
    """The finish's selection (bitonic sort of (mass, index), prefix sum, count below the
    threshold; plain jnp here) is exactly `wise_core.reference.select_blocks` on masses whose
    every partial sum is exact (multiples of 2**-12, many ties and zeros, some subnormal), so
    no summation order can tell them apart."""
    from wise_jax.kernels.pallas_decode import _select_ranked
    rng = np.random.default_rng(n)
    mass = (rng.integers(0, 6, (64, n)) * rng.integers(0, 2, (64, n))).astype(np.float32) * 2.0 ** -12
    mass[::7, :] = 2.0 ** -12  # all tied
    mass[3, :] = 0.0  # all zero: rank 0 (block 0) only
    mass[5, : n // 2] = np.float32(1e-40)  # subnormals count as 0
    for eta in (0.5, 0.95, 1.0):
        order, kept = jax.vmap(lambda m: _select_ranked(m, eta))(jnp.asarray(mass))
        got = np.zeros(mass.shape, bool)
        np.put_along_axis(got, np.asarray(order), np.asarray(kept), axis=-1)
        assert np.array_equal(got, ref.select_blocks(mass, eta)), eta


@pytest.mark.parametrize("n_listed,tile_blocks,split_blocks,min_splits,sizes", [
    (33, 2, 32, 1, [18, 15]),  # even splits of whole tiles, not 32 + 1
    (17, 2, 32, 1, [17]),
    (64, 2, 32, 1, [32, 32]),
    (65, 2, 32, 1, [22, 22, 21]),
    (6, 2, 8, 3, [2, 2, 2]),  # min_splits
    (3, 2, 8, 4, [2, 1]),  # fewer tiles than min_splits: one tile each
    (1, 2, 32, 1, [1]),
])
def test_split_rule_is_even_and_bounded(n_listed, tile_blocks, split_blocks, min_splits, sizes):
    """_split_size: the fewest splits of at most split_blocks (up to min_splits for a short
    row), whole tiles each, as even as that allows; KernelConfig.max_splits bounds it."""
    from wise_jax.kernels.pallas_decode import _split_size
    size = int(_split_size(jnp.int32(n_listed), tile_blocks=tile_blocks, split_blocks=split_blocks,
                           min_splits=min_splits))
    assert size % tile_blocks == 0
    got = [min(size, n_listed - lo) for lo in range(0, n_listed, size)]
    assert got == sizes
    config = KernelConfig(tile_n=32 * tile_blocks, split_keys=32 * split_blocks, min_splits=min_splits)
    assert len(got) <= config.max_splits(32, n_listed)


def test_splits_are_the_split_plans():
    """Each split's running max (the split kernel's m partial) is the max score over the keys
    `wise_core.split_plan` gives it: rows of 11, 10, 6 and 2 blocks at up to 4 a split, tiles
    of 2 and min_splits 3 (4 + 4 + 3, 4 + 4 + 2, 2 + 2 + 2, 2)."""
    from wise_jax.kernels.pallas_decode import _split_call
    spec = dict(COMBOS["page32-mha-d64-f32"], max_pages=12, seq_lens=[330, 300, 161, 33])
    case = make_case(4, **spec)
    config = KernelConfig(tile_n=64, split_keys=128, min_splits=3)
    batch, heads, head_dim = case["q"].shape
    modes = jnp.full((batch,), M.DENSE, jnp.int32)
    outputs = _split_call(case["q"], case["k"], case["v"], case["page_table"], case["seq_lens"], modes,
                          case["support"], block_size=BLOCK, scale=head_dim ** -0.5, config=config, finish=None,
                          return_mass=False, interpret=True)
    m = np.asarray(outputs[4], np.float64)  # [batch, heads, splits_pad]
    assert m.shape[-1] == 4  # the grid's 3 splits (max_splits of 12 blocks), padded to a power of two
    for b, n_keys in enumerate(spec["seq_lens"]):
        q, keys, _ = _row_keys(case, b)
        scores = np.einsum("hd,nhd->hn", q, keys) * np.log2(np.e) / np.sqrt(head_dim)  # MHA, base 2
        plan = split_plan.split_plan(n_keys, tile_n=64, split_keys=128, min_splits=3, block_size=BLOCK)
        for h in range(heads):
            # float32 scores: rounding.score_error of scale |q| max |k| (Cauchy-Schwarz), base 2
            bound = np.log2(np.e) * rounding.score_error(
                np.linalg.norm(q[h]) * np.linalg.norm(keys[:, h], axis=-1).max() / np.sqrt(head_dim), head_dim)
            for s, (lo, hi) in enumerate(plan):
                assert abs(m[b, h, s] - scores[h, lo:hi].max()) <= bound, (b, h, s)


def test_grid_of_the_plans_most_splits():
    """min_splits past a row's tiles: the grid has the plan's most splits of the widest row (6
    blocks, tiles of 4: 2 splits), not min_splits (8) programs a row; the modes' properties hold."""
    config = KernelConfig(tile_n=128, split_keys=256, min_splits=8)
    assert config.max_splits(BLOCK, 6) == 2
    check_modes(COMBOS["page32-mha-d64-f32"], config=config)


def test_fused_finish_equals_finish_launch():
    """The last split finishing (fused_finish) gives bitwise what the separate finish gives."""
    case = make_case(8, **COMBOS["page64-gqa-d128-bf16"])
    modes = [M.DISCOVER, M.SPARSE, M.DISCOVER_UNION, M.DENSE]
    separate = run(case, modes, config=dataclasses.replace(FUSED, fused_finish=False))
    fused = run(case, modes, config=FUSED)
    for a, b in zip(separate, fused):
        assert np.array_equal(bits(a), bits(b))


def test_matches_jnp_reference():
    """Every mode against wise_jax.attention.decode_attention_reference (float32)."""
    from wise_jax.attention import decode_attention_reference
    case = make_case(2, **COMBOS["page32-mha-d64-f32"])
    modes = jnp.asarray([M.DISCOVER, M.DISCOVER_UNION, M.SPARSE, M.DENSE], jnp.int32)
    args = (case["q"], case["k"], case["v"], case["page_table"], case["seq_lens"], modes,
            case["support"])
    out, support, mass = decode_attention(*args, block_size=BLOCK, eta=ETA, return_mass=True)
    ref_out, ref_support, ref_mass = decode_attention_reference(*args, block_size=BLOCK, eta=ETA,
                                                                return_mass=True)
    for b in range(4):  # both implementations round: twice each bound
        assert_within(np.asarray(out[b]), np.asarray(ref_out[b]), 2 * out_bound(case, b), f"row {b}")
    for b in range(2):
        assert_within(np.asarray(mass[b]), np.asarray(ref_mass[b]), 2 * mass_bound(case, b), f"mass row {b}")
    assert np.array_equal(np.asarray(support), np.asarray(ref_support))


def fp8_case(seed, spec):
    """(the case with fp8 pages: k, v uint8 e4m3fn codes and k_scale, v_scale float32, by
    `wise_core.kv_quant`; the case with their dequantized pages in the case's dtype). Codes
    planted: -0 (0x80) at some of a row's keys, NaN (0x7F) in every slot past the rows' keys."""
    case = make_case(seed, **spec)
    dtype = jnp.dtype(spec["dtype"]).name
    held = held_slots(case["page_table"], case["seq_lens"], *case["k"].shape[:2])
    fp8, dequantized = dict(case), dict(case)
    for name in ("k", "v"):
        codes, scales = kv_quant.quantize(np.asarray(case[name].astype(jnp.float32)))
        codes[~held] = kv_quant.NAN_CODE
        codes[held.nonzero()[0][:5], held.nonzero()[1][:5], :, ::7] = 0x80
        fp8[name], fp8[f"{name}_scale"] = jnp.asarray(codes), jnp.asarray(scales)
        dequantized[name] = jnp.asarray(kv_quant.dequantize(codes, scales, dtype))
    return fp8, dequantized


@pytest.mark.parametrize("interpret", [False, True])
def test_fp8_codes_decode_to_the_specs_values(interpret):
    """The kernel's in-register dequantization of every code, at scales from MIN_SCALE to 1e30,
    into each dtype: bitwise `wise_core.kv_quant.dequantize` (NaN codes NaN), under jit."""
    codes = np.tile(np.arange(256, dtype=np.uint8), (6, 1))
    scales = np.array([1.0, kv_quant.MIN_SCALE, 3.7e-3, 0.37, 1e30, 2.5e-20], np.float32)[:, None]
    for dtype in ("float32", "bfloat16", "float16"):
        fn = jax.jit(functools.partial(pallas_decode._dequantize, dtype=jnp.dtype(dtype), interpret=interpret))
        got = np.asarray(fn(jnp.asarray(codes), jnp.asarray(scales)).astype(jnp.float32))
        want = kv_quant.dequantize(codes[:, None, :], scales, dtype)[:, 0].astype(np.float32)
        assert np.array_equal(np.isnan(got), np.isnan(want))
        assert np.array_equal(bits(got)[~np.isnan(got)], bits(want)[~np.isnan(want)]), dtype


FP8_GQA = dict(COMBOS["page64-gqa-d48-bf16"], page_size=32, heads=2, kv_heads=1, max_pages=3, seq_lens=[96, 70, 33, 64])


def test_fp8_pages_read_as_their_dequantized_values():
    """k_scale, v_scale: the kernel reads fp8 pages, dequantized in registers by the spec's
    arithmetic: every mode's output, support' and mass are bitwise the call's on the dequantized
    pages (the tests above hold that call to the references), the NaN codes past every row's keys
    reach nothing; against wise_jax.attention.decode_attention_reference reading the same pages,
    within twice each bound (both round) and the same selection up to rounding of the threshold.
    GQA, padded lanes (head_dim 48), bf16 reductions over tiles of two pages (where the
    interpreter's XLA would drop the rounding to bf16 unless made explicit: `_dequantize`). fp8
    pages without both scales are refused."""
    from wise_jax.attention import decode_attention_reference
    fp8, dequantized = fp8_case(6, FP8_GQA)
    modes = [M.DISCOVER, M.DISCOVER_UNION, M.SPARSE, M.DENSE]
    scales = dict(k_scale=fp8["k_scale"], v_scale=fp8["v_scale"])
    got = run(fp8, modes, config=SPLIT, **scales)
    assert np.isnan(np.asarray(dequantized["k"].astype(jnp.float32))).any()    # the planted NaN codes
    for a, b in zip(got, run(dequantized, modes, config=SPLIT)):
        assert a.dtype == b.dtype and np.array_equal(bits(a), bits(b))
    out, support, mass = got
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
    args = (fp8["q"], fp8["k"], fp8["v"], fp8["page_table"], fp8["seq_lens"], jnp.asarray(modes, jnp.int32),
            fp8["support"])
    ref_out, _, ref_mass = decode_attention_reference(*args, block_size=BLOCK, eta=ETA, return_mass=True, **scales)
    for b in range(4):
        assert_within(np.asarray(out[b].astype(jnp.float32)), np.asarray(ref_out[b].astype(jnp.float32)),
                      2 * out_bound(dequantized, b, SPLIT), f"row {b}")
    for b in range(2):
        assert_within(np.asarray(mass[b]), np.asarray(ref_mass[b]), 2 * mass_bound(dequantized, b), f"mass row {b}")
        assert_selection(np.asarray(support[b]), np.asarray(mass[b]), np.asarray(fp8["support"][b]) & (b == 1),
                         exact=False)
    with pytest.raises(ValueError, match="k_scale and v_scale must be given together"):
        decode_attention(*args, block_size=BLOCK, eta=ETA, k_scale=fp8["k_scale"])
    with pytest.raises(ValueError, match="q, k_pages and v_pages must share one dtype"):
        decode_attention(*args, block_size=BLOCK, eta=ETA)


def test_nan_past_a_rows_keys_never_reaches_it():
    check_stale_nan_unread(dict(COMBOS["page64-gqa-d128-bf16"], max_pages=2, seq_lens=[97, 70, 65]))


def test_mixed_batch_rows_equal_rows_alone():
    """Each row of a mixed-mode batch gets bitwise what it gets in a batch of one."""
    case = make_case(3, **COMBOS["page64-gqa-d128-bf16"])
    modes = [M.SPARSE, M.DISCOVER, M.DENSE, M.DISCOVER_UNION]
    out, support, mass = run(case, modes)
    for b in range(4):
        alone = {name: (x[b:b + 1] if name not in ("k", "v") else x) for name, x in case.items()}
        out_b, support_b, mass_b = run(alone, [modes[b]])
        assert np.array_equal(bits(out_b[0]), bits(out[b]))
        assert np.array_equal(np.asarray(support_b[0]), np.asarray(support[b]))
        if modes[b] in (M.DISCOVER, M.DISCOVER_UNION):
            assert np.array_equal(bits(mass_b[0]), bits(mass[b]))


def test_selection_ties_eta_one_and_all_blocks():
    """Equal masses rank by index; eta=1 keeps every block with mass; all_blocks keeps the causal."""
    spec = dict(COMBOS["page32-mha-d64-f32"], seq_lens=[192, 150, 70, 33])
    case = make_case(4, **spec)
    flat = dict(case, k=jnp.zeros_like(case["k"]))  # every score 0: mass = keys per block / seq_len
    modes = [M.DISCOVER] * 4
    _, support, mass = run(flat, modes, eta=0.4)
    assert np.array_equal(np.asarray(support), ref.select_blocks(np.asarray(mass), 0.4))
    np.testing.assert_array_equal(np.asarray(support[0, 0]), [1, 1, 1, 0, 0, 0])  # 6 equal blocks

    _, support, mass = run(case, modes, eta=1.0)
    assert np.array_equal(np.asarray(support), ref.select_blocks(np.asarray(mass), 1.0))

    _, support, _ = run(case, [M.DISCOVER, M.DISCOVER_UNION, M.DENSE, M.SPARSE], all_blocks=True)
    n_blocks = case["support"].shape[-1]
    causal = np.stack([ref.causal_blocks(int(n), BLOCK, n_blocks) for n in case["seq_lens"]])
    held = np.asarray(case["support"])
    assert np.array_equal(np.asarray(support[0]), np.broadcast_to(causal[0], held[0].shape))
    assert np.array_equal(np.asarray(support[1]), held[1] | causal[1])
    assert np.array_equal(np.asarray(support[2:]), held[2:])


def test_jit_and_default_config_match_eager():
    """Under jax.jit (traced inputs, the dispatcher's case) the result is bitwise the eager one."""
    case = make_case(5, **COMBOS["page128-gqa-d64-bf16"])
    modes = jnp.asarray([M.DISCOVER, M.SPARSE, M.DENSE, M.DISCOVER_UNION], jnp.int32)
    args = (case["q"], case["k"], case["v"], case["page_table"], case["seq_lens"], modes,
            case["support"])
    call = functools.partial(decode_attention, block_size=BLOCK, eta=ETA, return_mass=True)
    eager = call(*args)
    jitted = jax.jit(call)(*args)
    for a, b in zip(eager, jitted):
        assert np.array_equal(bits(a), bits(b))
    out, support = decode_attention(*args, block_size=BLOCK, eta=ETA)
    assert np.array_equal(bits(out), bits(eager[0]))


def _bad(**change):
    case = make_case(6, **COMBOS["page32-mha-d64-f32"])
    args = dict(q=case["q"], k_pages=case["k"], v_pages=case["v"], page_table=case["page_table"],
                seq_lens=case["seq_lens"], modes=jnp.zeros(4, jnp.int32), support=case["support"],
                block_size=BLOCK, eta=ETA)
    args.update(change)
    return args


BAD = {
    "q rank": (dict(q=jnp.zeros((4, 128))), "q must be"),
    "v shape": (dict(v_pages=jnp.zeros((27, 32, 2, 32))), "v_pages"),
    "head_dim mismatch": (dict(q=jnp.zeros((4, 2, 32))), "head_dim"),
    "heads not multiple": (dict(q=jnp.zeros((4, 3, 64)), support=jnp.zeros((4, 3, 6), bool)),
                           "multiple"),
    "page not multiple of block": (dict(block_size=64), "page_size"),
    "head_dim neither a power of two nor a multiple of 16": (
        dict(q=jnp.zeros((4, 2, 40)), k_pages=jnp.zeros((27, 32, 2, 40)), v_pages=jnp.zeros((27, 32, 2, 40))),
        "head_dim must be a power of two or a multiple of 16 .* got 40"),
    "block not power of two": (dict(block_size=24), "block_size"),
    "eta": (dict(eta=1.5), "eta"),
    "support shape": (dict(support=jnp.zeros((4, 2, 5), bool)), "support"),
    "support dtype": (dict(support=jnp.zeros((4, 2, 6), jnp.int32)), "support"),
    "seq_lens dtype": (dict(seq_lens=jnp.zeros(4, jnp.float32)), "seq_lens"),
    "modes shape": (dict(modes=jnp.zeros(3, jnp.int32)), "modes"),
    "page_table dtype": (dict(page_table=jnp.zeros((4, 6), jnp.float32)), "page_table"),
    "q dtype": (dict(q=jnp.zeros((4, 2, 64), jnp.int32)), "share one dtype"),
    "seq_len too long": (dict(seq_lens=jnp.asarray([193, 1, 1, 1], jnp.int32)), "seq_lens"),
    "seq_len zero": (dict(seq_lens=jnp.asarray([0, 1, 1, 1], jnp.int32)), "seq_lens"),
    "unknown mode": (dict(modes=jnp.asarray([0, 1, 2, 7], jnp.int32)), "modes"),
    "page out of pool": (dict(page_table=jnp.full((4, 6), 27, jnp.int32)), "page_table"),
}


@pytest.mark.parametrize("change", [dict(tile_n=48), dict(split_keys=32), dict(num_warps=3),
                                    dict(min_splits=0), dict(num_stages=0), dict(tile_n=True)])
def test_kernel_config_rejects_bad_settings(change):
    with pytest.raises(ValueError, match="KernelConfig"):
        KernelConfig(**change)


def test_dots_need_head_dim_16():
    case = make_case(6, **dict(COMBOS["page32-mha-d64-f32"], head_dim=8))
    with pytest.raises(ValueError, match="dots needs head_dim >= 16"):
        run(case, [M.DENSE] * 4, config=DOTS)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise(name):
    change, message = BAD[name]
    with pytest.raises(ValueError, match=message):
        decode_attention(**_bad(**change))


# ------------------------------------------------------------------------------------------------
# On a GPU: compiled kernels (default launch config) at larger shapes.

def on_gpu(test):
    skip = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU backend")
    return pytest.mark.gpu(skip(test))

GPU_COMBOS = {
    "ouro-page128-d128-bf16": dict(page_size=128, heads=16, kv_heads=16, head_dim=128,
                                   dtype=jnp.bfloat16, max_pages=16,
                                   seq_lens=[2048, 1900, 1000, 513, 1717, 1500, 2000, 64]),
    "gqa-page32-d64-f32": dict(page_size=32, heads=8, kv_heads=2, head_dim=64, dtype=jnp.float32,
                               max_pages=40, seq_lens=[1280, 999, 1280, 700, 640, 1100, 33, 1000]),
    "gqa-page64-d128-bf16": dict(page_size=64, heads=4, kv_heads=1, head_dim=128,
                                 dtype=jnp.bfloat16, max_pages=12,
                                 seq_lens=[768, 700, 512, 300, 767, 640, 65, 500]),
    "huginn-page128-d96-bf16": dict(page_size=128, heads=55, kv_heads=55, head_dim=96,  # huginn-0125, MHA
                                    dtype=jnp.bfloat16, max_pages=16,
                                    seq_lens=[2048, 1900, 1000, 513, 1717, 1500, 2000, 64]),
}


@pytest.mark.parametrize("fused_finish", [False, True])
@pytest.mark.parametrize("name", list(GPU_COMBOS))
@on_gpu
def test_gpu_modes_against_references_and_dense(name, fused_finish):
    """The table's launch (two launches) and with the fused finish."""
    spec = GPU_COMBOS[name]
    config = dataclasses.replace(config_for(spec["head_dim"], spec["dtype"]), fused_finish=fused_finish)
    check_modes(spec, config=config, exact=False)


@on_gpu
def test_gpu_mixed_batch_rows_equal_rows_alone_and_jnp_reference():
    from wise_jax.attention import decode_attention_reference
    case = make_case(7, **GPU_COMBOS["ouro-page128-d128-bf16"])
    modes = [M.SPARSE, M.DISCOVER, M.DENSE, M.DISCOVER_UNION] * 2
    config = KernelConfig(tile_n=64, split_keys=256, min_splits=4, num_stages=3, dots=True,
                          fused_finish=True)
    out, support, mass = run(case, modes, config=config)
    # The fused finish reads other programs' partials: repeated runs and the separate finish
    # launch must agree bitwise.
    for again in [run(case, modes, config=config) for _ in range(4)] + [
            run(case, modes, config=dataclasses.replace(config, fused_finish=False))]:
        for a, b in zip((out, support, mass), again):
            assert np.array_equal(bits(a), bits(b))
    for b in range(len(modes)):
        alone = {name: (x[b:b + 1] if name not in ("k", "v") else x) for name, x in case.items()}
        out_b, support_b, mass_b = run(alone, [modes[b]], config=config)
        assert np.array_equal(bits(out_b[0]), bits(out[b]))
        assert np.array_equal(np.asarray(support_b[0]), np.asarray(support[b]))
        if modes[b] in (M.DISCOVER, M.DISCOVER_UNION):
            assert np.array_equal(bits(mass_b[0]), bits(mass[b]))
    ref_out, _, ref_mass = decode_attention_reference(
        case["q"], case["k"], case["v"], case["page_table"], case["seq_lens"],
        jnp.asarray(modes, jnp.int32), case["support"], block_size=BLOCK, eta=ETA, return_mass=True)
    for b, mode in enumerate(modes):  # both implementations round: twice each bound
        assert_within(np.asarray(out[b].astype(jnp.float32)), np.asarray(ref_out[b].astype(jnp.float32)),
                      2 * out_bound(case, b, config), f"row {b}")
        if mode in (M.DISCOVER, M.DISCOVER_UNION):
            assert_within(np.asarray(mass[b]), np.asarray(ref_mass[b]), 2 * mass_bound(case, b), f"mass row {b}")


@pytest.mark.parametrize("name", ["ouro-page128-d128-bf16", "gqa-page32-d64-f32"])
@on_gpu
def test_gpu_fp8_pages_read_as_their_dequantized_values(name):
    """The compiled kernel (the table's launch) on fp8 pages: bitwise its call on the dequantized
    pages, every mode, the NaN codes past the rows' keys unread; within twice each bound of the
    jnp reference reading the same pages (selection within rounding of the threshold)."""
    from wise_jax.attention import decode_attention_reference
    spec = GPU_COMBOS[name]
    config = config_for(spec["head_dim"], spec["dtype"])
    fp8, dequantized = fp8_case(11, spec)
    modes = [M.DISCOVER, M.DISCOVER_UNION, M.SPARSE, M.DENSE] * 2
    scales = dict(k_scale=fp8["k_scale"], v_scale=fp8["v_scale"])
    got = run(fp8, modes, config=config, **scales)
    for a, b in zip(got, run(dequantized, modes, config=config)):
        assert a.dtype == b.dtype and np.array_equal(bits(a), bits(b))
    out, support, mass = got
    ref_out, _, ref_mass = decode_attention_reference(
        fp8["q"], fp8["k"], fp8["v"], fp8["page_table"], fp8["seq_lens"], jnp.asarray(modes, jnp.int32),
        fp8["support"], block_size=BLOCK, eta=ETA, return_mass=True, **scales)
    for b in range(len(modes)):
        assert_within(np.asarray(out[b].astype(jnp.float32)), np.asarray(ref_out[b].astype(jnp.float32)),
                      2 * out_bound(dequantized, b, config), f"row {b}")
        if modes[b] in (M.DISCOVER, M.DISCOVER_UNION):
            assert_within(np.asarray(mass[b]), np.asarray(ref_mass[b]), 2 * mass_bound(dequantized, b), f"mass {b}")
            held = np.asarray(fp8["support"][b]) & (modes[b] == M.DISCOVER_UNION)
            assert_selection(np.asarray(support[b]), np.asarray(mass[b]), held, exact=False)
