"""wise_torch.layers: the fused Triton kernels against the torch versions, and the torch versions
against the HF computations (written out below, as wise_torch.model computes them).

Without CUDA the Triton kernels run in the interpreter (tests/conftest.py) at small shapes; the
`gpu` tests repeat the checks at Ouro-1.4B shapes (hidden 2048, intermediate 5632, 16 heads x 128)
with prefill-sized batches, CUDA-graph capture and replay, no host sync and no allocation beyond
the outputs. Tolerances are the bounds stated in the layers' docstrings.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wise_torch import layers as L

pytestmark = pytest.mark.cuda   # on the GPU when there is one (the gpu suite runs it there)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-6


# -- the HF computations (wise_torch.model: RMSNorm, rope_cos_sin, apply_rope, MLP) ---------------------
def hf_rms_norm(x, weight, eps=EPS):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def hf_rope_cos_sin(positions, head_dim, theta):
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def hf_apply_rope(x, cos, sin):
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[..., None, :] + rotated * sin[..., None, :]).to(x.dtype)


# -- tolerances -----------------------------------------------------------------------------------------
def ulp(t: torch.Tensor) -> torch.Tensor:
    """Spacing of t's dtype above |t|, as float32."""
    a = t.abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).float()


def rms_bound(want: torch.Tensor, hidden: int) -> torch.Tensor:
    """rms_norm's documented bound at the torch values `want`."""
    if want.dtype == torch.float32:
        return (hidden + 16) * 2.0 ** -24 * want.abs()
    return 2 * ulp(want)


def silu_bound(want: torch.Tensor) -> torch.Tensor:
    """silu_mul's documented bound (the interpreter's exp; bitwise expected on CUDA)."""
    if want.dtype == torch.float32:
        return 16 * 2.0 ** -24 * want.abs()
    return 2 * ulp(want)


def assert_within(got, want, bound, what=""):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    diff = (got.float() - want.float()).abs()
    bad = ~(diff <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the bound, worst "
                           f"{diff[bad].max().item():.3g} (bound {bound[bad].min().item():.3g})")


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device=DEVICE, dtype=dtype)


def norm_weight(hidden, dtype, seed):
    return randn(hidden, dtype=dtype, seed=seed, scale=0.3) + 1


# -- rms_norm / add_rms_norm ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [128, 2048])
def test_rms_norm(dtype, hidden):
    weight = norm_weight(hidden, dtype, seed=1)
    wide = randn(9, hidden + 64, dtype=dtype, seed=2, scale=3)
    for n in (0, 1, 7):
        x = wide[:n, :hidden]  # rows with a stride wider than the row
        want = L.rms_norm(x, weight, EPS, impl="torch")
        assert torch.equal(want, hf_rms_norm(x, weight))
        got = L.rms_norm(x, weight, EPS, impl="triton")
        assert torch.equal(L.rms_norm(x, weight, EPS), got if CUDA else want)  # "auto"
        assert_within(got, want, rms_bound(want, hidden), f"rms_norm n={n}")
        if n:
            if dtype != torch.float32:  # the float32 differences rarely cross a rounding boundary
                assert (got == want).float().mean() > 0.9
            alone = L.rms_norm(x[n // 2:n // 2 + 1].contiguous(), weight, EPS, impl="triton")
            assert torch.equal(alone, got[n // 2:n // 2 + 1])  # a row's result does not depend on the batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [128, 2048])
def test_add_rms_norm(dtype, hidden):
    n = 5
    x = randn(n, hidden, dtype=dtype, seed=3)
    residual = randn(n, hidden, dtype=dtype, seed=4, scale=4)
    post, nxt, final = (norm_weight(hidden, dtype, seed=s) for s in (5, 6, 7))

    # torch: the model's junction, op for op.
    h = residual + hf_rms_norm(x, post)
    for next_weight, final_weight in ((nxt, None), (None, None), (nxt, final), (None, final)):
        want_h = h if final_weight is None else hf_rms_norm(h, final_weight)
        got_h, got_normed = L.add_rms_norm(x, residual, post, next_weight, EPS, final_weight, impl="torch")
        assert torch.equal(got_h, want_h)
        assert (got_normed is None) == (next_weight is None)
        if next_weight is not None:
            assert torch.equal(got_normed, hf_rms_norm(want_h, next_weight))

    # Triton, stage by stage against torch on the kernel's own inputs of each stage.
    post_normed = hf_rms_norm(x, post)
    sum_only, none = L.add_rms_norm(x, residual, post, None, EPS, impl="triton")
    assert none is None
    assert_within(sum_only, h, rms_bound(post_normed, hidden) + torch.maximum(ulp(h), ulp(sum_only)), "residual + norm")
    for next_weight, final_weight in ((nxt, None), (nxt, final), (None, final)):
        got_h, got_normed = L.add_rms_norm(x, residual, post, next_weight, EPS, final_weight, impl="triton")
        if final_weight is None:
            assert torch.equal(got_h, sum_only)
        else:
            want = hf_rms_norm(sum_only, final_weight)
            assert_within(got_h, want, rms_bound(want, hidden), "final norm")
        if next_weight is not None:
            want = hf_rms_norm(got_h, next_weight)
            assert_within(got_normed, want, rms_bound(want, hidden), "next norm")
            alone = L.add_rms_norm(x[2:3], residual[2:3], post, next_weight, EPS, final_weight, impl="triton")
            assert torch.equal(alone[0], got_h[2:3]) and torch.equal(alone[1], got_normed[2:3])
    empty = L.add_rms_norm(x[:0], residual[:0], post, nxt, EPS, final, impl="triton")
    assert empty[0].shape == empty[1].shape == (0, hidden)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
def test_rms_norm_keeps_nan_and_inf_visible():
    x = randn(3, 128, dtype=torch.float32, seed=8)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    weight = norm_weight(128, torch.float32, seed=9)
    for impl in ("torch", "triton"):
        y = L.rms_norm(x, weight, EPS, impl=impl)
        assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all() and torch.isnan(y[2, 7])


# -- rope_store_kv ----------------------------------------------------------------------------------------
ROPE_CASES = [  # (qkv dtype, plane dtype, heads, kv_heads, head_dim, page_size)
    (torch.float32, torch.float32, 4, 2, 32, 32),     # GQA
    (torch.bfloat16, torch.bfloat16, 2, 2, 64, 128),  # MHA
    (torch.bfloat16, torch.bfloat16, 8, 2, 128, 32),  # GQA, head_dim 128
    (torch.float32, torch.bfloat16, 3, 3, 128, 128),  # MHA, odd heads; fp32 activations, bf16 cache
]


def rope_inputs(dtype, plane_dtype, heads, kv_heads, head_dim, page_size, n, seed, num_pages=6):
    qkv = randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed, scale=2)
    g = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, 3000, (n,), generator=g).to(DEVICE)
    slots = torch.randperm(num_pages * page_size, generator=g)[:n].to(DEVICE)  # scattered, out of order
    k_plane = randn(num_pages, page_size, kv_heads, head_dim, dtype=plane_dtype, seed=seed + 2)
    v_plane = randn(num_pages, page_size, kv_heads, head_dim, dtype=plane_dtype, seed=seed + 3)
    return qkv, positions, slots, k_plane, v_plane


def test_rope_table_is_the_hf_cos_sin():
    for head_dim, theta in ((32, 10_000.0), (64, 1e6), (128, 1e6)):
        table = L.rope_table(4096, head_dim, theta, device=DEVICE)
        assert table.shape == (4096, head_dim) and table.dtype == torch.float32
        positions = torch.tensor([0, 1, 17, 4095, 2048, 3], device=DEVICE)
        cos, sin = hf_rope_cos_sin(positions, head_dim, theta)
        half = head_dim // 2
        assert torch.equal(table[positions, :half], cos[:, :half]) and torch.equal(table[positions, half:], sin[:, :half])


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-h{c[2]}-kv{c[3]}-d{c[4]}-p{c[5]}".replace("torch.", ""))
def test_rope_store_kv(case):
    dtype, plane_dtype, heads, kv_heads, head_dim, page_size = case
    n = 7
    qkv, positions, slots, k_plane, v_plane = rope_inputs(*case, n=n, seed=10)
    table = L.rope_table(3000, head_dim, 1e6, device=DEVICE)
    args = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim)

    # torch: the model's rotation and cache write.
    k_torch, v_torch = k_plane.clone(), v_plane.clone()
    q_torch = L.rope_store_kv(qkv, positions, table, k_torch, v_torch, slots, impl="torch", **args)
    cos, sin = hf_rope_cos_sin(positions, head_dim, 1e6)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    assert torch.equal(q_torch, hf_apply_rope(q.view(n, heads, head_dim), cos, sin))
    want_k, want_v = k_plane.clone(), v_plane.clone()
    want_k.view(-1, kv_heads, head_dim)[slots] = hf_apply_rope(k.view(n, kv_heads, head_dim), cos, sin).to(plane_dtype)
    want_v.view(-1, kv_heads, head_dim)[slots] = v.reshape(n, kv_heads, head_dim).to(plane_dtype)
    assert torch.equal(k_torch, want_k) and torch.equal(v_torch, want_v)

    # Triton: bitwise the same q and planes (nothing else in the planes touched).
    k_tri, v_tri = k_plane.clone(), v_plane.clone()
    q_tri = L.rope_store_kv(qkv, positions, table, k_tri, v_tri, slots, impl="triton", **args)
    assert q_tri.shape == (n, heads, head_dim) and q_tri.dtype == dtype
    assert torch.equal(q_tri, q_torch) and torch.equal(k_tri, k_torch) and torch.equal(v_tri, v_torch)

    empty = L.rope_store_kv(qkv[:0], positions[:0], table, k_tri, v_tri, slots[:0], impl="triton", **args)
    assert empty.shape == (0, heads, head_dim) and torch.equal(k_tri, k_torch)


def test_rope_store_kv_out_of_range_is_nan_not_a_stray_write():
    case = ROPE_CASES[0]
    dtype, _, heads, kv_heads, head_dim, page_size = case
    qkv, positions, slots, k_plane, v_plane = rope_inputs(*case, n=5, seed=20)
    table = L.rope_table(3000, head_dim, 1e4, device=DEVICE)
    args = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    num_slots = k_plane.shape[0] * page_size
    bad_pos, bad_slot = positions.clone(), slots.clone()
    bad_pos[1] = 3000        # past the table
    bad_slot[3] = num_slots  # past the planes
    bad_slot[4] = -1
    k_tri, v_tri = k_plane.clone(), v_plane.clone()
    q = L.rope_store_kv(qkv, bad_pos, table, k_tri, v_tri, bad_slot, impl="triton", **args)
    k_ref, v_ref = k_plane.clone(), v_plane.clone()
    q_ref = L.rope_store_kv(qkv[[0, 2]], positions[[0, 2]], table, k_ref, v_ref, slots[[0, 2]], impl="torch", **args)
    assert torch.equal(q[[0, 2]], q_ref)
    assert torch.isnan(q[[1, 3, 4]]).all()
    # The bad position's k is NaN at its (valid) slot; the bad slots wrote nothing.
    flat_k = k_tri.view(-1, kv_heads, head_dim)
    assert torch.isnan(flat_k[slots[1]]).all() and torch.equal(v_tri.view(-1, kv_heads, head_dim)[slots[1]],
                                                               qkv[1, (heads + kv_heads) * head_dim:].view(kv_heads, head_dim))
    flat_k[slots[1]] = k_ref.view(-1, kv_heads, head_dim)[slots[1]]
    v_tri.view(-1, kv_heads, head_dim)[slots[1]] = v_ref.view(-1, kv_heads, head_dim)[slots[1]]
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    if not CUDA:  # on CUDA the torch version's check is a device-side assert, fatal to the process
        for pos, slot, message in ((bad_pos, slots, "position"), (positions, bad_slot, "slot")):
            with pytest.raises(RuntimeError, match=message):
                L.rope_store_kv(qkv, pos, table, k_plane.clone(), v_plane.clone(), slot, impl="torch", **args)


# -- silu_mul ---------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [256, 1500])
def test_silu_mul(dtype, inter):
    gate_up = randn(5, 2 * inter, dtype=dtype, seed=30, scale=4)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow, saturation, zeros
    for n in (0, 1, 5):
        x = gate_up[:n]
        want = L.silu_mul(x, impl="torch")
        assert torch.equal(want, F.silu(x[:, :inter]) * x[:, inter:])
        got = L.silu_mul(x, impl="triton")
        assert_within(got, want, silu_bound(want), f"silu_mul n={n}")
        if n:
            assert (got == want).float().mean() > 0.5
            assert torch.equal(L.silu_mul(x[n - 1:], impl="triton"), got[n - 1:])


# -- argument checks --------------------------------------------------------------------------------------
def test_bad_arguments_are_clear_errors():
    f32 = dict(dtype=torch.float32, device=DEVICE)
    x, w = torch.zeros(3, 64, **f32), torch.ones(64, **f32)
    qkv = torch.zeros(2, 4 * 32, **f32)
    pos = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    table = L.rope_table(16, 32, 1e4, device=DEVICE)
    plane = torch.zeros(2, 32, 1, 32, **f32)
    rope = dict(heads=2, kv_heads=1, head_dim=32)
    cases = [
        (lambda: L.rms_norm(x[0], w, EPS), "2-D"),
        (lambda: L.rms_norm(x.t(), torch.ones(3, **f32), EPS), "contiguous along features"),
        (lambda: L.rms_norm(x, w.double(), EPS), "weight must be torch.float32\\[64\\]"),
        (lambda: L.rms_norm(x, torch.ones(32, **f32), EPS), "weight must be"),
        (lambda: L.rms_norm(x.long(), w, EPS), "x must be one of"),
        (lambda: L.rms_norm(x, w, -1.0), "eps"),
        (lambda: L.rms_norm(x, w, EPS, impl="cuda"), "impl must be one of"),
        (lambda: L.add_rms_norm(x, x[:2], w, w, EPS), "same tokens"),
        (lambda: L.add_rms_norm(x, x.bfloat16(), w, w, EPS), "residual must be torch.float32"),
        (lambda: L.add_rms_norm(x, x, w, torch.ones(63, **f32), EPS), "next_weight"),
        (lambda: L.rope_store_kv(qkv[:, :-1], pos, table, plane, plane.clone(), pos, **rope), "128 features"),
        (lambda: L.rope_store_kv(qkv, pos.int(), table, plane, plane.clone(), pos, **rope), "positions must be"),
        (lambda: L.rope_store_kv(qkv, pos, table, plane, plane.clone(), pos[:1], **rope), "slot_mapping must be"),
        (lambda: L.rope_store_kv(qkv, pos, table.double(), plane, plane.clone(), pos, **rope), "cos_sin must be"),
        (lambda: L.rope_store_kv(qkv, pos, table[:, :16], plane, plane.clone(), pos, **rope), "cos_sin must be"),
        (lambda: L.rope_store_kv(qkv, pos, table, plane, plane.bfloat16(), pos, **rope), "share shape, dtype"),
        (lambda: L.rope_store_kv(qkv, pos, table, plane[..., :16], plane[..., :16], pos, **rope), "k_plane must be"),
        (lambda: L.rope_store_kv(qkv, pos, table, plane, plane.clone(), pos, heads=3, kv_heads=2, head_dim=16),
         "not a multiple"),
        (lambda: L.rope_store_kv(torch.zeros(2, 4 * 33, **f32), pos, table, plane, plane.clone(), pos,
                                 heads=2, kv_heads=1, head_dim=33), "even"),
        (lambda: L.silu_mul(torch.zeros(2, 7, **f32)), "even width"),
        (lambda: L.rope_table(0, 32, 1e4), "max_positions"),
        (lambda: L.rope_table(8, 31, 1e4), "even"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    if CUDA:
        with pytest.raises(ValueError, match="one device"):
            L.rms_norm(x, w.cpu(), EPS)


# -- on the GPU: Ouro-1.4B shapes, prefill-sized batches, CUDA graphs ---------------------------------------
OURO = dict(hidden=2048, inter=5632, heads=16, kv_heads=16, head_dim=128, page_size=128, theta=1e6)


def ouro_inputs(n, dtype, seed):
    o = OURO
    qkv_width = (o["heads"] + 2 * o["kv_heads"]) * o["head_dim"]
    num_pages = n // o["page_size"] + 3
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=randn(n, o["hidden"], dtype=dtype, seed=seed, scale=2),
        residual=randn(n, o["hidden"], dtype=dtype, seed=seed + 1, scale=8),
        weights=[norm_weight(o["hidden"], dtype, seed=seed + 2 + i) for i in range(3)],
        qkv=randn(n, qkv_width, dtype=dtype, seed=seed + 5, scale=2),
        gate_up=randn(n, 2 * o["inter"], dtype=dtype, seed=seed + 6, scale=3),
        positions=torch.randint(0, 65536, (n,), generator=g).to(DEVICE),
        slots=torch.randperm(num_pages * o["page_size"], generator=g)[:n].to(DEVICE),
        k_plane=randn(num_pages, o["page_size"], o["kv_heads"], o["head_dim"], dtype=dtype, seed=seed + 7),
        v_plane=randn(num_pages, o["page_size"], o["kv_heads"], o["head_dim"], dtype=dtype, seed=seed + 8))


ROPE_ARGS = dict(heads=OURO["heads"], kv_heads=OURO["kv_heads"], head_dim=OURO["head_dim"])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 10, 64, 16384])
def test_gpu_ouro_shapes(n, dtype):
    a = ouro_inputs(n, dtype, seed=n)
    hidden = OURO["hidden"]
    post, nxt, final = a["weights"]
    want = L.rms_norm(a["x"], post, EPS, impl="torch")
    got = L.rms_norm(a["x"], post, EPS)
    assert_within(got, want, rms_bound(want, hidden), "rms_norm")

    h_torch = a["residual"] + want
    h, none = L.add_rms_norm(a["x"], a["residual"], post, None, EPS)
    assert none is None
    assert_within(h, h_torch, rms_bound(want, hidden) + torch.maximum(ulp(h), ulp(h_torch)), "residual + norm")
    h2, normed = L.add_rms_norm(a["x"], a["residual"], post, nxt, EPS)
    assert torch.equal(h2, h)
    want_normed = hf_rms_norm(h, nxt)
    assert_within(normed, want_normed, rms_bound(want_normed, hidden), "next norm")
    h3, normed3 = L.add_rms_norm(a["x"], a["residual"], post, nxt, EPS, final)
    want_final = hf_rms_norm(h, final)
    assert_within(h3, want_final, rms_bound(want_final, hidden), "final norm")
    want_normed3 = hf_rms_norm(h3, nxt)
    assert_within(normed3, want_normed3, rms_bound(want_normed3, hidden), "next norm after final")

    table = L.rope_table(65536, OURO["head_dim"], OURO["theta"], device=DEVICE)
    planes_torch = a["k_plane"].clone(), a["v_plane"].clone()
    planes_tri = a["k_plane"].clone(), a["v_plane"].clone()
    q_torch = L.rope_store_kv(a["qkv"], a["positions"], table, *planes_torch, a["slots"], impl="torch", **ROPE_ARGS)
    q_tri = L.rope_store_kv(a["qkv"], a["positions"], table, *planes_tri, a["slots"], **ROPE_ARGS)
    assert torch.equal(q_tri, q_torch)
    assert torch.equal(planes_tri[0], planes_torch[0]) and torch.equal(planes_tri[1], planes_torch[1])

    want_silu = L.silu_mul(a["gate_up"], impl="torch")
    assert_within(L.silu_mul(a["gate_up"]), want_silu, silu_bound(want_silu), "silu_mul")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_silu_mul_is_bitwise_torch(dtype):
    """libdevice expf and IEEE division, as torch's CUDA silu: the same bits."""
    gate_up = randn(4096, 2 * OURO["inter"], dtype=dtype, seed=40, scale=6)
    assert torch.equal(L.silu_mul(gate_up), L.silu_mul(gate_up, impl="torch"))


def _layer_ops(a, table):
    """The four ops as a decode layer calls them, on the static inputs `a`."""
    post, nxt, final = a["weights"]
    x = L.rms_norm(a["x"], post, EPS)
    h, normed = L.add_rms_norm(x, a["residual"], post, nxt, EPS, final)
    q = L.rope_store_kv(a["qkv"], a["positions"], table, a["k_plane"], a["v_plane"], a["slots"], **ROPE_ARGS)
    return x, h, normed, q, L.silu_mul(a["gate_up"])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_cuda_graph_capture_and_replay():
    n = 20
    static = ouro_inputs(n, torch.bfloat16, seed=50)
    table = L.rope_table(65536, OURO["head_dim"], OURO["theta"], device=DEVICE)
    _layer_ops(static, table)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _layer_ops(static, table)
    for seed in (51, 52):
        fresh = ouro_inputs(n, torch.bfloat16, seed=seed)
        for key in ("x", "residual", "qkv", "gate_up", "positions", "slots", "k_plane", "v_plane"):
            static[key].copy_(fresh[key])
        graph.replay()
        torch.cuda.synchronize()
        eager = _layer_ops(dict(fresh, weights=static["weights"]), table)  # the graph holds static's weights
        for got, want in zip(outs, eager):
            assert torch.equal(got, want)
        assert torch.equal(static["k_plane"], fresh["k_plane"]) and torch.equal(static["v_plane"], fresh["v_plane"])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_no_host_sync_and_no_allocation_beyond_outputs():
    a = ouro_inputs(64, torch.bfloat16, seed=60)
    table = L.rope_table(65536, OURO["head_dim"], OURO["theta"], device=DEVICE)
    _layer_ops(a, table)  # compile
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = _layer_ops(a, table)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    granule = 512  # the caching allocator's rounding
    out_bytes = sum(-(-t.numel() * t.element_size() // granule) * granule for t in outs)
    assert torch.cuda.max_memory_allocated() - before <= out_bytes
