"""wise_torch.attention: prefill attention, the torch selection rule, and every mode of the
reference decode attention against wise_core.reference."""

import random
import sys

import numpy as np
import pytest
import torch

from cases import held_slots
from wise_core import reference as ref
from wise_core import rounding
from wise_core.modes import DENSE, DISCOVER, DISCOVER_UNION, SPARSE
from wise_torch.attention import (auto_kernel, decode_attention, decode_attention_reference, prefill_attention,
                                  resolve_kernel, select_blocks)
from wise_torch.verification import resolve_verify_kernel, verify_attention_reference

BLOCK = 32


def ambiguous_rows(mass: np.ndarray, eta: float) -> np.ndarray:
    """Rows where the running sum before a positive block lies within `rounding.selection_margin`
    of eta * total, so that the summation order may decide that block; bool[rows]."""
    ranked = -np.sort(-mass.astype(np.float64), axis=-1)
    before = np.cumsum(ranked, -1) - ranked
    total = ranked.sum(-1, keepdims=True)
    close = np.abs(before - eta * total) <= rounding.selection_margin(mass.shape[-1], 1.0) * total
    return (close & (ranked > 0)).any(-1)


def test_select_blocks_matches_numpy_hand_made():
    cases = [([0.25, 0.25, 0.25, 0.25], 0.5), ([0.1, 0.4, 0.1, 0.4], 0.85), ([0.0, 0.0, 0.0], 0.95),
             ([0.0, 0.5, 0.0, 0.5], 1.0), ([0.1, 0.2, 0.3, 0.4], 1.0), ([0.7], 0.95),
             ([0.01, 0.96, 0.03], 0.95)]
    for mass, eta in cases:
        expected = ref.select_blocks(np.array(mass, np.float32), eta)
        assert np.array_equal(select_blocks(torch.tensor(mass), eta).numpy(), expected), (mass, eta)
    with pytest.raises(ValueError, match="eta"):
        select_blocks(torch.ones(3), 0.0)


@pytest.mark.parametrize("eta", [0.5, 0.95, 1.0])
def test_select_blocks_matches_numpy_random(eta):
    rng = np.random.default_rng(0)
    mass = rng.dirichlet(np.full(24, 1.0), size=(64,)).astype(np.float32)
    mass[:8, 12:] = 0.0  # rows with non-causal (zero) tail blocks
    mass[8:16, :4] = mass[8:16, 4:8]  # exact ties
    got = select_blocks(torch.from_numpy(mass), eta).numpy()
    want = ref.select_blocks(mass, eta)
    clear = ~ambiguous_rows(mass, eta)
    assert clear.sum() >= 60
    assert np.array_equal(got[clear], want[clear])


def test_prefill_attention_gqa_matches_numpy():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, h, 16, generator=g) for h in (4, 2, 2))
    out = prefill_attention(q, k, v)
    for b in range(2):
        for t in range(7):
            want, _ = ref.attention(q[b, t].numpy(), k[b, :t + 1].numpy(), v[b, :t + 1].numpy(), block_size=4)
            np.testing.assert_allclose(out[b, t].numpy(), want, atol=1e-5, rtol=0)


def paged_problem(seq_lens=(1, 45, 96, 70), heads=4, kv_heads=2, dim=16, page_size=64, seed=0):
    """Random keys/values stored in shuffled pages; returns the call's arguments and the
    per-row contiguous K/V."""
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    max_pages = -(-max(seq_lens) // page_size)
    num_pages = batch * max_pages + 1
    k_pages = torch.randn(num_pages, page_size, kv_heads, dim, generator=g) * 2.0
    v_pages = torch.randn(num_pages, page_size, kv_heads, dim, generator=g)
    order = list(range(num_pages))
    random.Random(seed).shuffle(order)
    page_table = torch.tensor(order[:batch * max_pages], dtype=torch.int32).reshape(batch, max_pages)
    q = torch.randn(batch, heads, dim, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    contiguous = [(k_pages[page_table[b].long()].reshape(-1, kv_heads, dim)[:n],
                   v_pages[page_table[b].long()].reshape(-1, kv_heads, dim)[:n]) for b, n in enumerate(seq_lens)]
    max_blocks = max_pages * page_size // BLOCK
    return q, k_pages, v_pages, page_table, lens, max_blocks, contiguous


def call(q, k_pages, v_pages, table, lens, modes, support, eta=0.9):
    modes = torch.full((q.shape[0],), modes, dtype=torch.int32) if isinstance(modes, int) else modes
    return decode_attention_reference(q, k_pages, v_pages, table, lens, modes, support, block_size=BLOCK,
                                      eta=eta, return_mass=True)


def test_dense_matches_numpy_and_discovery_is_bitwise_dense():
    q, kp, vp, table, lens, nb, contiguous = paged_problem()
    support = torch.zeros(q.shape[0], q.shape[1], nb, dtype=torch.bool)
    dense, s_dense, _ = call(q, kp, vp, table, lens, DENSE, support.clone())
    assert not s_dense.any()  # DENSE leaves the support as it was
    for b, (k, v) in enumerate(contiguous):
        want, _ = ref.attention(q[b].numpy(), k.numpy(), v.numpy(), block_size=BLOCK)
        bound = rounding.attention_bound_of(q[b].numpy(), k.numpy(), v.numpy())  # fp32 vs fp64
        assert np.abs(dense[b].numpy() - want).max() <= bound
    for mode in (DISCOVER, DISCOVER_UNION):
        out, _, _ = call(q, kp, vp, table, lens, mode, support.clone())
        assert torch.equal(out, dense)
    mixed = torch.tensor([DISCOVER, DENSE, DISCOVER_UNION, DENSE], dtype=torch.int32)
    out, _, _ = call(q, kp, vp, table, lens, mixed, support.clone())
    assert torch.equal(out, dense)


def test_nan_past_a_rows_keys_never_reaches_it():
    """NaN in every slot that is not one of a row's keys (a reused page's stale slots) changes no
    output, support or mass, bitwise, in any mode: a value there is read as 0, not as 0 x NaN."""
    q, kp, vp, table, lens, nb, _ = paged_problem()
    held = torch.from_numpy(held_slots(table, lens, *kp.shape[:2]))[..., None, None]
    stale = [x.masked_fill(~held, float("nan")) for x in (kp, vp)]
    modes = torch.tensor([DISCOVER, SPARSE, DENSE, DISCOVER_UNION], dtype=torch.int32)
    support = torch.zeros(q.shape[0], q.shape[1], nb, dtype=torch.bool)
    support[:, :, 0] = support[1, :, 1] = True
    got, want = (call(q, k, v, table, lens, modes, support.clone()) for k, v in (stale, (kp, vp)))
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_discover_mass_and_selection():
    q, kp, vp, table, lens, nb, contiguous = paged_problem(seed=1)
    support = torch.ones(q.shape[0], q.shape[1], nb, dtype=torch.bool)  # DISCOVER overwrites it
    eta = 0.9
    _, new, mass = call(q, kp, vp, table, lens, DISCOVER, support, eta=eta)
    assert new is support  # in place
    for b, (k, v) in enumerate(contiguous):
        _, want_mass = ref.attention(q[b].numpy(), k.numpy(), v.numpy(), block_size=BLOCK)
        bound = rounding.mass_bound_of(q[b].numpy(), k.numpy())
        assert np.abs(mass[b, :, :want_mass.shape[1]].numpy() - want_mass).max() <= bound
        assert not mass[b, :, want_mass.shape[1]:].any()  # non-causal blocks carry no mass
        assert not new[b, :, want_mass.shape[1]:].any()
    # The selection is exactly select_blocks of the returned mass, and numpy's rule on it.
    assert torch.equal(new, select_blocks(mass, eta))
    m = mass.numpy()
    clear = ~ambiguous_rows(m, eta)
    assert np.array_equal(new.numpy()[clear], ref.select_blocks(m, eta)[clear])


def test_union_is_or_of_per_depth_selections():
    q1, kp1, vp1, table, lens, nb, _ = paged_problem(seed=2)
    q2, kp2, vp2, _, _, _, _ = paged_problem(seed=3)
    support = torch.zeros(q1.shape[0], q1.shape[1], nb, dtype=torch.bool)
    _, first, mass1 = call(q1, kp1, vp1, table, lens, DISCOVER, support, eta=0.5)
    first = first.clone()
    _, union, mass2 = call(q2, kp2, vp2, table, lens, DISCOVER_UNION, support, eta=0.5)
    assert torch.equal(first, select_blocks(mass1, 0.5))
    assert torch.equal(union, first | select_blocks(mass2, 0.5))
    assert union.sum() > first.sum()  # the second depth added blocks


def test_sparse_matches_numpy_on_its_support():
    q, kp, vp, table, lens, nb, contiguous = paged_problem(seed=4)
    g = torch.Generator().manual_seed(5)
    support = torch.rand(q.shape[0], q.shape[1], nb, generator=g) < 0.5
    support[:, :, 0] = True  # every row selects a causal block
    before = support.clone()
    out, after, mass = call(q, kp, vp, table, lens, SPARSE, support)
    assert torch.equal(after, before)
    for b, (k, v) in enumerate(contiguous):
        n = ref.num_blocks(len(k), BLOCK)
        want, want_mass = ref.attention(q[b].numpy(), k.numpy(), v.numpy(), block_size=BLOCK,
                                        support=before[b, :, :n].numpy())
        assert np.abs(out[b].numpy() - want).max() <= rounding.attention_bound_of(q[b].numpy(), k.numpy(), v.numpy())
        assert np.abs(mass[b, :, :n].numpy() - want_mass).max() <= rounding.mass_bound_of(q[b].numpy(), k.numpy())


def test_sparse_with_every_causal_block_is_bitwise_dense():
    q, kp, vp, table, lens, nb, _ = paged_problem(seed=6)
    causal = torch.arange(nb)[None, :] * BLOCK < lens[:, None]
    support = causal[:, None, :].expand(q.shape[0], q.shape[1], nb).clone()
    sparse, _, _ = call(q, kp, vp, table, lens, SPARSE, support)
    dense, _, _ = call(q, kp, vp, table, lens, DENSE, support.clone())
    assert torch.equal(sparse, dense)
    support[:, :, :] = True  # blocks past seq_len never count
    sparse_all, _, _ = call(q, kp, vp, table, lens, SPARSE, support)
    assert torch.equal(sparse_all, dense)


def test_bfloat16_inputs_keep_dtype_and_modes_agree():
    q, kp, vp, table, lens, nb, _ = paged_problem(seed=7)
    support = torch.zeros(q.shape[0], q.shape[1], nb, dtype=torch.bool)
    args = (q.bfloat16(), kp.bfloat16(), vp.bfloat16(), table, lens)
    dense, _, _ = call(*args, DENSE, support.clone())
    disc, _, _ = call(*args, DISCOVER, support.clone())
    assert dense.dtype == torch.bfloat16 and torch.equal(dense, disc)


def test_bad_arguments_are_named():
    q, kp, vp, table, lens, nb, _ = paged_problem()
    support = torch.zeros(q.shape[0], q.shape[1], nb, dtype=torch.bool)
    modes = torch.zeros(q.shape[0], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be"):
        call(q[0], kp, vp, table, lens, modes, support)
    with pytest.raises(ValueError, match="support must be bool"):
        call(q, kp, vp, table, lens, modes, support[:, :, :-1])
    with pytest.raises(ValueError, match="seq_lens must be"):
        call(q, kp, vp, table, lens[:-1], modes, support)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        call(q[:, :3], kp, vp, table, lens, modes, support[:, :3])
    with pytest.raises(ValueError, match="block_size must be a positive power of two"):
        decode_attention_reference(q, kp, vp, table, lens, modes, support, block_size=48, eta=0.9)
    with pytest.raises(ValueError, match=r"block_size must be a positive power of two \(an int\), got 0"):
        decode_attention_reference(q, kp, vp, table, lens, modes, support, block_size=0, eta=0.9)
    with pytest.raises(ValueError, match=r"eta must be a number in \(0, 1\], got 1.5"):
        call(q, kp, vp, table, lens, modes, support, eta=1.5)


def test_kernel_dispatch(monkeypatch):
    assert resolve_kernel("auto", "cpu") is decode_attention_reference
    assert resolve_kernel("reference", "cpu") is decode_attention_reference
    with pytest.raises(ValueError, match="'pallas' is not available in wise_torch"):
        resolve_kernel("pallas", "cpu")
    # "auto" on CUDA: the Triton kernels for head dims they take (multiples of 16), else the reference
    assert [auto_kernel("cuda", d) for d in (128, 96, 48, 16, None)] == ["triton"] * 5
    assert [auto_kernel("cuda", d) for d in (40, 8, 100)] == ["reference"] * 3
    assert auto_kernel("cpu", 96) == "reference"
    assert resolve_kernel("auto", "cuda", 40) is decode_attention_reference
    assert resolve_verify_kernel("auto", "cuda", 40) is verify_attention_reference
    monkeypatch.setitem(sys.modules, "wise_torch.kernels.triton_decode", None)  # import fails
    with pytest.raises(RuntimeError, match="Triton decode kernel .* cannot be imported"):
        resolve_kernel("triton", "cpu")
    q, kp, vp, table, lens, nb, _ = paged_problem()
    support = torch.zeros(q.shape[0], q.shape[1], nb, dtype=torch.bool)
    modes = torch.zeros(q.shape[0], dtype=torch.int32)
    out, _ = decode_attention(q, kp, vp, table, lens, modes, support, block_size=BLOCK, eta=0.9,
                              kernel="reference")
    want, _ = decode_attention_reference(q, kp, vp, table, lens, modes, support.clone(), block_size=BLOCK, eta=0.9)
    assert torch.equal(out, want)
