"""The Triton paged decode kernel against the numpy specification and the torch reference.

Without CUDA the kernel runs in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET),
so shapes are tiny and the split size is cut to 64 keys to give rows several splits. The `gpu`
tests repeat the checks at larger shapes with the table's launch configurations.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cases import held_slots
from parity.environment import widen_interpreted_bf16_dots
from wise_core import reference as ref
from wise_core import rounding, split_plan
from wise_core.modes import DENSE, DISCOVER, DISCOVER_UNION, SPARSE
from wise_torch import kv_quant
from wise_torch.attention import decode_attention_reference
from wise_torch.kernels.triton_decode import (DecodeWorkspace, KernelConfig, all_blocks_support,
                                              config_for, decode_attention)

pytestmark = pytest.mark.cuda   # on the GPU when there is one (the gpu suite runs it there)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BLOCK = 32
ETA = 0.9
SMALL = KernelConfig(tile_n=32, split_keys=64, num_warps=4, num_stages=2)  # 2 blocks per split
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


if not CUDA:
    widen_interpreted_bf16_dots()


@dataclasses.dataclass
class Case:
    q: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int = BLOCK

    @property
    def max_blocks(self) -> int:
        return self.page_table.shape[1] * self.k_pages.shape[1] // self.block_size

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    def keys(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """The row's keys and values in order, float64 [seq_len, kv_heads, head_dim]."""
        n = int(self.seq_lens[row])
        pages = self.page_table[row].long()
        k = self.k_pages[pages].flatten(0, 1)[:n]
        v = self.v_pages[pages].flatten(0, 1)[:n]
        return k.double().cpu().numpy(), v.double().cpu().numpy()

    def workspace(self, config: KernelConfig | None = SMALL, batch: int | None = None) -> DecodeWorkspace:
        batch, heads, head_dim = self.q.shape if batch is None else (batch,) + self.q.shape[1:]
        return DecodeWorkspace.allocate(batch, heads, self.k_pages.shape[2], head_dim, self.max_blocks,
                                        dtype=self.q.dtype, device=self.q.device, block_size=self.block_size,
                                        config=config)

    def row(self, b: int) -> "Case":
        return dataclasses.replace(self, q=self.q[b:b + 1], page_table=self.page_table[b:b + 1],
                                   seq_lens=self.seq_lens[b:b + 1])


def make_case(seq_lens, *, heads=2, kv_heads=2, head_dim=64, page_size=32, dtype=torch.float32,
              seed=0, device=DEVICE) -> Case:
    """Random cache with pages out of order, one spare page per row, peaked queries."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    max_pages = max(-(-n // page_size) for n in seq_lens) + 1
    num_pages = batch * max_pages + 3
    page_table = torch.randperm(num_pages, generator=gen)[:batch * max_pages].reshape(batch, max_pages)
    shape = (num_pages, page_size, kv_heads, head_dim)
    to = dict(device=device, dtype=dtype)
    return Case(q=(3 * torch.randn(batch, heads, head_dim, generator=gen)).to(**to),
                k_pages=torch.randn(shape, generator=gen).to(**to),
                v_pages=torch.randn(shape, generator=gen).to(**to),
                page_table=page_table.to(device=device, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device))


def run(case: Case, modes, support, workspace=None, **kw):
    """decode_attention on `case` with per-row `modes`; returns (out, support, mass)."""
    modes = torch.tensor(modes, dtype=torch.int32, device=case.q.device)
    return decode_attention(case.q, case.k_pages, case.v_pages, case.page_table, case.seq_lens, modes,
                            support, block_size=case.block_size, eta=ETA, return_mass=True,
                            workspace=case.workspace() if workspace is None else workspace, **kw)


def random_support(case: Case, density: float, seed: int) -> torch.Tensor:
    """bool[batch, heads, max_blocks]; every (row, head) keeps at least its first block."""
    gen = torch.Generator().manual_seed(seed)
    support = torch.rand(case.q.shape[0], case.heads, case.max_blocks, generator=gen) < density
    support[:, :, 0] = True
    return support.to(case.q.device)


def numpy_attention(case: Case, support: torch.Tensor | None = None):
    """Per-row float64 reference: (out [batch, heads, dim], mass [batch, heads, max_blocks])."""
    outs, masses = [], []
    for b in range(case.q.shape[0]):
        k, v = case.keys(b)
        sup = None if support is None else support[b].cpu().numpy()
        out, mass = ref.attention(case.q[b].double().cpu().numpy(), k, v, block_size=case.block_size,
                                  support=sup)
        if sup is None:
            mass = np.pad(mass, ((0, 0), (0, case.max_blocks - mass.shape[1])))
        outs.append(out)
        masses.append(mass)
    return np.stack(outs), np.stack(masses)


def out_bounds(case: Case) -> np.ndarray:
    """float64[batch, 1, 1]: `rounding.attention_bound_of` each row, dense (an upper bound for
    its sparse subsets too, which attend fewer keys of the same magnitudes). bf16: the kernel
    feeds probabilities to bf16 tensor-core dots and rounds the output to bf16."""
    dtype = str(case.q.dtype).removeprefix("torch.")
    low = None if dtype == "float32" else dtype
    bounds = [rounding.attention_bound_of(case.q[b].double().cpu().numpy(), *case.keys(b), out_dtype=dtype,
                                          p_dtype=low) for b in range(case.q.shape[0])]
    return np.array(bounds)[:, None, None]


def mass_bounds(case: Case) -> np.ndarray:
    """float64[batch, 1, 1]: `rounding.mass_bound_of` each row (dense)."""
    bounds = [rounding.mass_bound_of(case.q[b].double().cpu().numpy(), case.keys(b)[0])
              for b in range(case.q.shape[0])]
    return np.array(bounds)[:, None, None]


def assert_within(got, want, bound) -> None:
    """|got - want| <= bound elementwise (bound broadcast per row)."""
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), f"max |diff| {err.max():.3g}; worst row's excess {np.max(err - bound):.3g}"


def assert_selection(support: np.ndarray, mass: np.ndarray, held: np.ndarray | None = None,
                     eta: float = ETA) -> None:
    """support == held | select_blocks(mass) exactly, on every (row, head) whose ranked running
    sum is not within `rounding.selection_margin` of the threshold (where summation order may
    decide)."""
    ranked = -np.sort(-mass.astype(np.float64), axis=-1)
    running = np.cumsum(ranked, axis=-1)
    total = running[..., -1:]
    margin = rounding.selection_margin(mass.shape[-1], 1.0) * total
    ambiguous = (np.abs(running - eta * total) <= margin).any(-1)
    assert ambiguous.mean() < 0.25, "too many near-threshold rows for a meaningful check"
    expected = ref.select_blocks(mass, eta) | (False if held is None else held)
    np.testing.assert_array_equal(support[~ambiguous], expected[~ambiguous])


LAYOUTS = {  # name: (page_size, heads, kv_heads, head_dim, dtype)
    "p32-mha-d64-fp32": (32, 2, 2, 64, torch.float32),
    "p64-gqa-d64-bf16": (64, 4, 2, 64, torch.bfloat16),
    "p128-mha-d128-bf16": (128, 2, 2, 128, torch.bfloat16),
    "p32-gqa-d128-fp32": (32, 4, 2, 128, torch.float32),
    # head_dim a multiple of 16, not a power of two: tiles padded to 128 / 64 lanes
    "p32-mha-d96-fp32": (32, 2, 2, 96, torch.float32),     # huginn-0125's head_dim, MHA as Huginn
    "p64-gqa-d48-bf16": (64, 4, 2, 48, torch.bfloat16),
    "p32-mha-d96-bf16": (32, 2, 2, 96, torch.bfloat16),
}
SEQ_LENS = [150, 64, 1, 97]  # several splits, exact blocks, one key, partial blocks


def layout_case(name: str, seq_lens=SEQ_LENS, seed=0) -> Case:
    page_size, heads, kv_heads, head_dim, dtype = LAYOUTS[name]
    return make_case(seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                     dtype=dtype, seed=seed)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dense_matches_references(layout):
    case = layout_case(layout)
    support = torch.zeros(len(SEQ_LENS), case.heads, case.max_blocks, dtype=torch.bool, device=DEVICE)
    out, support_out, _ = run(case, [DENSE] * len(SEQ_LENS), support.clone())
    expected, _ = numpy_attention(case)
    assert_within(out.double().cpu().numpy(), expected, out_bounds(case))
    assert not support_out.any(), "dense rows must not touch the support"
    torch_out, _ = decode_attention_reference(
        case.q, case.k_pages, case.v_pages, case.page_table, case.seq_lens,
        torch.full((len(SEQ_LENS),), DENSE, dtype=torch.int32, device=DEVICE), support.clone(),
        block_size=BLOCK, eta=ETA)
    assert_within(out.double().cpu().numpy(), torch_out.double().cpu().numpy(), 2 * out_bounds(case))  # both


@pytest.mark.parametrize("layout", ["p64-gqa-d64-bf16", "p32-mha-d64-fp32"])
def test_discovery_is_dense_bitwise_and_selects_by_the_rule(layout):
    case = layout_case(layout)
    batch = len(SEQ_LENS)
    held = random_support(case, 0.3, seed=1)
    dense, _, _ = run(case, [DENSE] * batch, held.clone())
    found, fresh, mass = run(case, [DISCOVER] * batch, held.clone())
    united, union, union_mass = run(case, [DISCOVER_UNION] * batch, held.clone())
    assert torch.equal(found, dense) and torch.equal(united, dense)
    assert torch.equal(mass, union_mass)

    _, expected_mass = numpy_attention(case)
    assert_within(mass.cpu().numpy(), expected_mass, mass_bounds(case))
    mass_np = mass.cpu().numpy()
    assert_selection(fresh.cpu().numpy(), mass_np)
    fresh_np = fresh.cpu().numpy()
    causal = np.arange(case.max_blocks) * BLOCK < case.seq_lens.cpu().numpy()[:, None, None]
    assert not (fresh_np & ~causal).any(), "a discovery selected a non-causal block"
    np.testing.assert_array_equal(union.cpu().numpy(), held.cpu().numpy() | fresh_np)


def test_union_across_discovery_depths():
    """Depth 0 discovers, depth 1 ORs its own selection in: the OR of the two selections."""
    first = layout_case("p32-mha-d64-fp32", seed=3)
    second = dataclasses.replace(first, q=torch.roll(first.q, 1, dims=1) * 0.5)
    batch = len(SEQ_LENS)
    support = torch.zeros(batch, first.heads, first.max_blocks, dtype=torch.bool, device=DEVICE)
    _, support, mass0 = run(first, [DISCOVER] * batch, support)
    sel0 = support.cpu().numpy().copy()
    _, support, mass1 = run(second, [DISCOVER_UNION] * batch, support)
    assert_selection(sel0, mass0.cpu().numpy())
    assert_selection(support.cpu().numpy(), mass1.cpu().numpy(), held=sel0)
    sel1 = ref.select_blocks(mass1.cpu().numpy(), ETA)
    assert (sel1 & ~sel0).any(), "the second depth should add blocks for the check to mean something"


@pytest.mark.parametrize("layout", ["p64-gqa-d64-bf16", "p128-mha-d128-bf16", "p32-mha-d64-fp32"])
def test_sparse_with_every_block_is_dense_bitwise(layout):
    case = layout_case(layout)
    batch = len(SEQ_LENS)
    support = all_blocks_support(case.seq_lens, case.heads, case.max_blocks, BLOCK)
    assert support.shape == (batch, case.heads, case.max_blocks)
    dense, _, _ = run(case, [DENSE] * batch, support.clone())
    sparse, after, _ = run(case, [SPARSE] * batch, support.clone())
    assert torch.equal(sparse, dense)
    assert torch.equal(after, support), "sparse rows must not touch the support"
    spare = support.clone()
    spare[:, :, -1] = True  # bits of blocks past seq_len are ignored
    assert torch.equal(run(case, [SPARSE] * batch, spare)[0], dense)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sparse_matches_masked_attention(layout):
    case = layout_case(layout, seed=5)
    support = random_support(case, 0.4, seed=6)
    out, _, _ = run(case, [SPARSE] * len(SEQ_LENS), support.clone())
    expected, _ = numpy_attention(case, support)
    assert_within(out.double().cpu().numpy(), expected, out_bounds(case))


def test_reuse_call_is_the_selecting_call_without_selection():
    """reuse=True compiles the finish without the selection: SPARSE and DENSE rows give the same
    outputs bitwise, the support is untouched, the mass zeros; a discovery row is refused."""
    case = make_case([150, 97, 130, 64], heads=4, kv_heads=2, seed=9)
    modes = [SPARSE, DENSE, SPARSE, DENSE]
    support = random_support(case, 0.5, seed=10)
    want, _, _ = run(case, modes, support.clone())
    got, after, mass = run(case, modes, support.clone(), reuse=True)
    assert torch.equal(got, want) and torch.equal(after, support)
    assert torch.equal(mass, torch.zeros_like(mass))
    with pytest.raises(ValueError, match="reuse call must be SPARSE or DENSE"):
        run(case, [DISCOVER, DENSE, SPARSE, DENSE], support.clone(), reuse=True)


def test_nan_past_a_rows_keys_never_reaches_it():
    """NaN in every slot that is not one of a row's keys (a reused page's stale slots, pages no
    row holds) changes no output, support or mass, bitwise, in any mode."""
    case = make_case([45, 96, 70, 1])
    held = torch.from_numpy(held_slots(case.page_table.cpu(), case.seq_lens.cpu(), *case.k_pages.shape[:2]))
    held = held.to(DEVICE)[..., None, None]
    stale = dataclasses.replace(case, k_pages=case.k_pages.masked_fill(~held, float("nan")),
                                v_pages=case.v_pages.masked_fill(~held, float("nan")))
    modes = [DISCOVER, SPARSE, DENSE, DISCOVER_UNION]
    support = random_support(case, 0.5, seed=3)
    got, want = (run(c, modes, support.clone()) for c in (stale, case))
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_mixed_batch_rows_match_each_row_alone():
    case = make_case([150, 97, 130, 64, 33], heads=4, kv_heads=2, seed=7)
    modes = [DENSE, DISCOVER, DISCOVER_UNION, SPARSE, SPARSE]
    support = random_support(case, 0.5, seed=8)
    out, together, mass = run(case, modes, support.clone())
    for b, mode in enumerate(modes):
        alone_out, alone_support, alone_mass = run(case.row(b), [mode], support[b:b + 1].clone(),
                                                   workspace=case.workspace(batch=1))
        assert torch.equal(out[b:b + 1], alone_out), f"row {b}"
        assert torch.equal(together[b:b + 1], alone_support), f"row {b}"
        if mode in (DISCOVER, DISCOVER_UNION):
            assert torch.equal(mass[b:b + 1], alone_mass), f"row {b}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mha_on_tensor_core_dots(dtype):
    """KernelConfig(mha_dots=True): MHA through the GQA dot path, same properties."""
    case = make_case(SEQ_LENS, dtype=dtype, seed=21)
    batch = len(SEQ_LENS)
    dots = dataclasses.replace(SMALL, mha_dots=True)
    every = all_blocks_support(case.seq_lens, case.heads, case.max_blocks, BLOCK)
    dense, _, _ = run(case, [DENSE] * batch, every.clone(), workspace=case.workspace(dots))
    assert_within(dense.double().cpu().numpy(), numpy_attention(case)[0], out_bounds(case))
    found, fresh, mass = run(case, [DISCOVER] * batch, every.clone(), workspace=case.workspace(dots))
    assert torch.equal(found, dense)
    assert_selection(fresh.cpu().numpy(), mass.cpu().numpy())
    assert torch.equal(run(case, [SPARSE] * batch, every.clone(), workspace=case.workspace(dots))[0], dense)


@pytest.mark.parametrize("layout", ["p64-gqa-d64-bf16", "p32-mha-d64-fp32"])
def test_min_splits_shrinks_splits_and_keeps_the_properties(layout):
    """KernelConfig(min_splits=3): a 5-block row runs 3 splits of 2 blocks, not 2 of 4; outputs,
    selections and the bitwise equalities are those of the plain split size."""
    case = layout_case(layout, seed=24)
    batch = len(SEQ_LENS)
    plain = KernelConfig(tile_n=64, split_keys=128, num_warps=4, num_stages=2)
    spread = dataclasses.replace(plain, min_splits=3)
    assert case.workspace(spread).max_splits == 3 > case.workspace(plain).max_splits
    every = all_blocks_support(case.seq_lens, case.heads, case.max_blocks, BLOCK)
    dense, _, _ = run(case, [DENSE] * batch, every.clone(), workspace=case.workspace(spread))
    assert_within(dense.double().cpu().numpy(), numpy_attention(case)[0], out_bounds(case))
    plain_dense = run(case, [DENSE] * batch, every.clone(), workspace=case.workspace(plain))[0]
    assert_within(dense.double().cpu().numpy(), plain_dense.double().cpu().numpy(), 2 * out_bounds(case))
    found, fresh, mass = run(case, [DISCOVER] * batch, every.clone(), workspace=case.workspace(spread))
    assert torch.equal(found, dense)
    assert_selection(fresh.cpu().numpy(), mass.cpu().numpy())
    assert torch.equal(run(case, [SPARSE] * batch, every.clone(), workspace=case.workspace(spread))[0], dense)
    support = random_support(case, 0.6, seed=25)
    sparse, _, _ = run(case, [SPARSE] * batch, support.clone(), workspace=case.workspace(spread))
    assert_within(sparse.double().cpu().numpy(), numpy_attention(case, support)[0], out_bounds(case))


def test_splits_are_the_split_plans():
    """Rows the plan splits evenly where split_keys a split would leave a short last one (5
    blocks at up to 4 a split: 3 + 2, not 4 + 1; 9 blocks: 3 + 3 + 3, not 4 + 4 + 1): each
    split's running max in the workspace is the max score over the plan's keys (the splits past
    the row's count untouched), and the outputs keep their properties."""
    config = KernelConfig(tile_n=32, split_keys=128, num_warps=4, num_stages=2)  # a block a step, 4 a split
    seq_lens = [150, 288, 97, 33]
    case = make_case(seq_lens, seed=31)  # float32 MHA, head_dim 64
    ws = case.workspace(config)
    ws.part_m.fill_(float("nan"))
    every = all_blocks_support(case.seq_lens, case.heads, case.max_blocks, BLOCK)
    dense, _, _ = run(case, [DENSE] * len(seq_lens), every.clone(), workspace=ws)
    part_m = ws.part_m.cpu().numpy().astype(np.float64)
    head_dim = case.q.shape[2]
    base2 = np.log2(np.e) / np.sqrt(head_dim)
    moved = False
    for b, n_keys in enumerate(seq_lens):
        q = case.q[b].double().cpu().numpy()
        k = case.keys(b)[0]
        scores = np.einsum("hd,nhd->hn", q, k) * base2  # [heads, n_keys], MHA
        # float32 scores: rounding.score_error of scale |q| max |k| (Cauchy-Schwarz), base 2
        bound = np.log2(np.e) * np.array([rounding.score_error(np.linalg.norm(q[h]) / np.sqrt(head_dim)
                                                               * np.linalg.norm(k[:, h], axis=-1).max(), head_dim)
                                          for h in range(case.heads)])
        plan = split_plan.split_plan(n_keys, tile_n=32, split_keys=128, block_size=BLOCK)
        for s, (lo, hi) in enumerate(plan):
            assert np.all(np.abs(part_m[b, :, s] - scores[:, lo:hi].max(1)) <= bound), (b, s)
            old_hi = min((s + 1) * 128, n_keys)  # the former rule's split s: split_keys keys
            moved |= bool(np.any(np.abs(scores[:, s * 128:old_hi].max(1) - scores[:, lo:hi].max(1)) > bound))
        assert np.isnan(part_m[b, :, len(plan):]).all(), f"row {b} ran more splits than the plan's"
    assert moved, "the check should tell the plan's splits from the former ones"
    assert_within(dense.double().cpu().numpy(), numpy_attention(case)[0], out_bounds(case))
    found, fresh, mass = run(case, [DISCOVER] * len(seq_lens), every.clone(), workspace=ws)
    assert torch.equal(found, dense)
    assert_selection(fresh.cpu().numpy(), mass.cpu().numpy())
    assert torch.equal(run(case, [SPARSE] * len(seq_lens), every.clone(), workspace=ws)[0], dense)


@pytest.mark.parametrize("block_size, page_size", [(16, 32), (64, 64)])
def test_other_block_sizes(block_size, page_size):
    case = dataclasses.replace(make_case(SEQ_LENS, page_size=page_size, seed=22), block_size=block_size)
    support = random_support(case, 0.5, seed=23)
    modes = [DISCOVER, SPARSE, DISCOVER_UNION, SPARSE]
    out, after, mass = run(case, modes, support.clone())
    dense_out, dense_mass = numpy_attention(case)
    sparse_out, _ = numpy_attention(case, support)
    expected = np.where(np.isin(modes, [SPARSE])[:, None, None], sparse_out, dense_out)
    assert_within(out.double().cpu().numpy(), expected, out_bounds(case))
    mass, after, support = mass.cpu().numpy(), after.cpu().numpy(), support.cpu().numpy()
    assert_within(mass[[0, 2]], dense_mass[[0, 2]], mass_bounds(case)[[0, 2]])
    assert_selection(after[[0]], mass[[0]])
    assert_selection(after[[2]], mass[[2]], held=support[[2]])
    np.testing.assert_array_equal(after[[1, 3]], support[[1, 3]])


def test_default_workspace_and_table_config():
    """No workspace: one is allocated with the table's configuration; results agree."""
    case = layout_case("p32-mha-d64-fp32")
    support = random_support(case, 0.5, seed=9)
    modes = [DISCOVER, SPARSE, DENSE, DISCOVER_UNION]
    out, sup, mass = decode_attention(
        case.q, case.k_pages, case.v_pages, case.page_table, case.seq_lens,
        torch.tensor(modes, dtype=torch.int32, device=DEVICE), support.clone(), block_size=BLOCK, eta=ETA,
        return_mass=True)
    small_out, small_sup, _ = run(case, modes, support.clone())
    assert_within(out.double().cpu().numpy(), small_out.double().cpu().numpy(), 2 * out_bounds(case))
    assert_selection(sup[[0]].cpu().numpy(), mass[[0]].cpu().numpy())
    assert torch.equal(sup[[1, 2]], support[[1, 2]])
    assert config_for(64, torch.float32).split_keys > SMALL.split_keys  # the two runs split differently


@pytest.mark.parametrize("layout, mha_dots", [("p32-mha-d96-fp32", False), ("p64-gqa-d48-bf16", False),
                                              ("p32-mha-d96-bf16", True)])
def test_padded_head_dim_modes(layout, mha_dots):
    """head_dim 96 / 48 (tiles of 128 / 64 lanes, the padded ones masked): dense within the
    bounds of the float64 reference (test_dense_matches_references), discovery bitwise dense
    with the mass within `rounding.mass_bound_of` and the eta rule's selection, every block
    selected bitwise dense, reuse rows (random support) within the bounds of masked attention,
    and no lane past head_dim stored (the workspace row after the batch keeps its sentinel)."""
    case = layout_case(layout, seed=41)
    batch = len(SEQ_LENS)
    ws = case.workspace(dataclasses.replace(SMALL, mha_dots=mha_dots), batch=batch + 1)
    ws.out.fill_(float("nan"))
    held = random_support(case, 0.4, seed=42)
    dense, _, _ = run(case, [DENSE] * batch, held.clone(), workspace=ws)
    dense = dense.clone()
    assert torch.isnan(ws.out[batch]).all(), "a lane past head_dim was stored"
    expected, expected_mass = numpy_attention(case)
    assert_within(dense.double().cpu().numpy(), expected, out_bounds(case))

    found, fresh, mass = run(case, [DISCOVER] * batch, held.clone(), workspace=ws)
    assert torch.equal(found, dense)
    assert_within(mass.cpu().numpy(), expected_mass, mass_bounds(case))
    assert_selection(fresh.cpu().numpy(), mass.cpu().numpy())
    united, union, _ = run(case, [DISCOVER_UNION] * batch, held.clone(), workspace=ws)
    assert torch.equal(united, dense)
    np.testing.assert_array_equal(union.cpu().numpy(), held.cpu().numpy() | fresh.cpu().numpy())

    every = all_blocks_support(case.seq_lens, case.heads, case.max_blocks, BLOCK)
    assert torch.equal(run(case, [SPARSE] * batch, every, workspace=ws)[0], dense)
    reused, after, _ = run(case, [SPARSE] * batch, held.clone(), workspace=ws, reuse=True)
    assert torch.equal(after, held)
    assert_within(reused.double().cpu().numpy(), numpy_attention(case, held)[0], out_bounds(case))
    assert torch.isnan(ws.out[batch]).all(), "a lane past head_dim was stored"


def test_padded_head_dim_mixed_batch_and_table_config():
    """head_dim 96 with the table's configuration (config_for: the 128-lane entry) and a mixed
    batch: each row equals the row alone bitwise, and the outputs agree with SMALL's splits."""
    case = make_case([150, 97, 130, 64], heads=4, kv_heads=2, head_dim=96, seed=43)
    modes = [DENSE, DISCOVER, SPARSE, DISCOVER_UNION]
    support = random_support(case, 0.5, seed=44)
    assert config_for(96, torch.float32) == config_for(128, torch.float32)
    table = case.workspace(config=None)
    out, together, _ = run(case, modes, support.clone(), workspace=table)
    out, together = out.clone(), together.clone()
    for b, mode in enumerate(modes):
        alone_out, alone_support, _ = run(case.row(b), [mode], support[b:b + 1].clone(),
                                          workspace=case.workspace(config=None, batch=1))
        assert torch.equal(out[b:b + 1], alone_out), f"row {b}"
        assert torch.equal(together[b:b + 1], alone_support), f"row {b}"
    small_out, _, _ = run(case, modes, support.clone())
    assert_within(out.double().cpu().numpy(), small_out.double().cpu().numpy(), 2 * out_bounds(case))  # both


def test_head_dim_not_a_multiple_of_16_is_refused():
    case = make_case([40, 70], head_dim=40, seed=45)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16 .* got 40"):
        _call(case)


def test_all_blocks_support():
    lens = torch.tensor([1, 32, 33, 0], dtype=torch.int32)
    got = all_blocks_support(lens, 2, 3, BLOCK)
    expected = np.stack([ref.all_blocks(int(n), BLOCK, (2,), 3) for n in lens])
    np.testing.assert_array_equal(got.numpy(), expected)


def _call(case: Case, **changes):
    args = dict(q=case.q, k_pages=case.k_pages, v_pages=case.v_pages, page_table=case.page_table,
                seq_lens=case.seq_lens, modes=torch.zeros(case.q.shape[0], dtype=torch.int32, device=DEVICE),
                support=torch.zeros(case.q.shape[0], case.heads, case.max_blocks, dtype=torch.bool, device=DEVICE))
    kw = dict(block_size=BLOCK, eta=ETA)
    for name, value in changes.items():
        (kw if name in ("block_size", "eta", "workspace") else args)[name] = value
    return decode_attention(**args, **kw)


def test_bad_input_raises_clear_errors():
    case = make_case([40, 70], seed=11)
    bad_pages = make_case([40, 70], page_size=48, seed=11)
    with pytest.raises(ValueError, match="q must be"):
        _call(case, q=case.q[0])
    with pytest.raises(ValueError, match="share one dtype"):
        _call(case, q=case.q.double())
    with pytest.raises(ValueError, match="share one dtype"):
        _call(case, k_pages=case.k_pages.bfloat16(), v_pages=case.v_pages.bfloat16())
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        _call(bad_pages, support=torch.zeros(2, 2, 3, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        _call(case, block_size=24)
    with pytest.raises(ValueError, match="support must be"):
        _call(case, support=torch.zeros(2, 2, 3, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="page_table must be int32"):
        _call(case, page_table=case.page_table.long())
    with pytest.raises(ValueError, match="eta"):
        _call(case, eta=0.0)
    with pytest.raises(ValueError, match="seq_lens must be in"):
        _call(case, seq_lens=torch.tensor([40, 1000], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="modes must be one of"):
        _call(case, modes=torch.tensor([0, 7], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="select no causal block"):
        _call(case, modes=torch.tensor([0, SPARSE], dtype=torch.int32, device=DEVICE))
    small = case.row(0).workspace()
    with pytest.raises(ValueError, match="max_batch"):
        _call(case, workspace=small)
    with pytest.raises(ValueError, match="dtype"):
        _call(case, workspace=DecodeWorkspace.allocate(2, 2, 2, 64, case.max_blocks, dtype=torch.bfloat16,
                                                       device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(tile_n=48)
    with pytest.raises(ValueError, match="min_splits"):
        KernelConfig(min_splits=0)


def fp8_pages(case: Case) -> tuple[Case, dict]:
    """case's K/V quantized as an fp8 cache holds them (`wise_torch.kv_quant`) -> (the case over
    the dequantized pages, in q's dtype; the codes and scales: the fp8 call's k_pages, v_pages,
    k_scale, v_scale)."""
    (k_codes, k_scale), (v_codes, v_scale) = kv_quant.quantize(case.k_pages), kv_quant.quantize(case.v_pages)
    dequantized = dataclasses.replace(case, k_pages=kv_quant.dequantize(k_codes, k_scale, case.q.dtype),
                                      v_pages=kv_quant.dequantize(v_codes, v_scale, case.q.dtype))
    return dequantized, dict(k_pages=k_codes, v_pages=v_codes, k_scale=k_scale, v_scale=v_scale)


def run_fp8(case: Case, pages: dict, modes, support, workspace=None, **kw):
    """decode_attention over fp8 pages (`fp8_pages`' dict) with `case`'s queries and rows."""
    modes = torch.tensor(modes, dtype=torch.int32, device=case.q.device)
    return decode_attention(case.q, pages["k_pages"], pages["v_pages"], case.page_table, case.seq_lens, modes,
                            support, block_size=case.block_size, eta=ETA, return_mass=True,
                            workspace=case.workspace() if workspace is None else workspace,
                            k_scale=pages["k_scale"], v_scale=pages["v_scale"], **kw)


def assert_fp8_is_the_dequantized_call(case: Case, modes, support, workspace=None) -> torch.Tensor:
    """Over fp8 pages the kernel's output, support' and mass are bitwise its own over the
    dequantized pages (a discovery call, then a reuse call); returns the output."""
    dequantized, pages = fp8_pages(case)
    want = [x.clone() for x in run(dequantized, modes, support.clone(), workspace)]
    got = run_fp8(case, pages, modes, support.clone(), workspace)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    reuse = [m if m in (DENSE, SPARSE) else SPARSE for m in modes]
    want = run(dequantized, reuse, support.clone(), workspace, reuse=True)[0].clone()
    assert torch.equal(run_fp8(case, pages, reuse, support.clone(), workspace, reuse=True)[0], want)
    return want


FP8_LAYOUTS = ["p32-gqa-d128-fp32", "p32-mha-d96-fp32"] + (["p64-gqa-d64-bf16"] if CUDA else [])


@pytest.mark.parametrize("layout", FP8_LAYOUTS)
def test_fp8_pages_are_read_as_their_dequantized_values(layout):
    """Codes and scales dequantized in registers (issue 50): every mode, GQA dots and the padded
    head_dim's lanes, bitwise the call over `wise_torch.kv_quant.dequantize`'s pages; a NaN code
    (0x7F) in a key's V makes that lane of its KV head's outputs NaN, as a NaN value does. Not
    run by the engine yet (`attention.resolve_kernel` refuses kernel="triton" for an fp8 pool).
    bfloat16 on a GPU only: Triton's interpreter rounds float32 -> bfloat16 toward zero, not to
    nearest even as a GPU's conversion and torch's do."""
    case = layout_case(layout)
    case = dataclasses.replace(case, k_pages=case.k_pages * torch.linspace(0.01, 100, case.k_pages.shape[1],
                                                                           dtype=case.q.dtype)[None, :, None, None])
    modes = [DENSE, DISCOVER, DISCOVER_UNION, SPARSE]
    out = assert_fp8_is_the_dequantized_call(case, modes, random_support(case, 0.5, seed=3))
    assert not out.isnan().any() and out.float().std() > 0.1
    _, pages = fp8_pages(case)
    page = int(case.page_table[0, 0])
    pages["v_pages"][page, 5, 0, 3] = 0x7F
    got = run_fp8(case, pages, modes, random_support(case, 0.5, seed=3))[0]
    group = case.heads // case.k_pages.shape[2]
    assert got[0, :group, 3].isnan().all() and int(got.isnan().sum()) == group   # that lane of its heads
    deep = case.workspace(config=dataclasses.replace(SMALL, num_stages=3))
    with pytest.raises(ValueError, match=r"fp8 pages run at num_stages <= 2 .* has 3"):
        run_fp8(case, pages, modes, random_support(case, 0.5, seed=3), deep)


# ---- GPU: the same properties at larger shapes with the table's configurations -------------

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size, dtype", [
    (16, 16, 128, 128, torch.bfloat16), (16, 4, 128, 64, torch.bfloat16), (8, 8, 64, 32, torch.float32),
    (55, 55, 96, 128, torch.bfloat16)])  # huginn-0125: 55 heads of 96, MHA
def test_gpu_modes_at_scale(heads, kv_heads, head_dim, page_size, dtype):
    lens = [4096, 1000, 2047, 33, 3000, 1]
    case = make_case(lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                     dtype=dtype, seed=12)
    batch = len(lens)
    ws = case.workspace(config=None)
    held = random_support(case, 0.2, seed=13)
    dense, _, _ = run(case, [DENSE] * batch, held.clone(), workspace=ws)
    dense = dense.clone()
    expected, expected_mass = numpy_attention(case)
    assert_within(dense.double().cpu().numpy(), expected, out_bounds(case))
    found, fresh, mass = run(case, [DISCOVER] * batch, held.clone(), workspace=ws)
    assert torch.equal(found, dense)
    assert_within(mass.cpu().numpy(), expected_mass, mass_bounds(case))
    assert_selection(fresh.cpu().numpy(), mass.cpu().numpy())
    every = all_blocks_support(case.seq_lens, heads, case.max_blocks, BLOCK)
    assert torch.equal(run(case, [SPARSE] * batch, every, workspace=ws)[0], dense)
    sparse, _, _ = run(case, [SPARSE] * batch, held.clone(), workspace=ws)
    expected_sparse, _ = numpy_attention(case, held)
    assert_within(sparse.double().cpu().numpy(), expected_sparse, out_bounds(case))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size, dtype", [
    (16, 16, 128, 128, torch.bfloat16), (16, 4, 128, 64, torch.bfloat16), (8, 8, 64, 32, torch.float32),
    (55, 55, 96, 128, torch.bfloat16)])
def test_gpu_fp8_pages_at_scale(heads, kv_heads, head_dim, page_size, dtype):
    """fp8 pages with their configurations (`config_for(..., "fp8")`), bfloat16 too (rounded to
    nearest even on a GPU): bitwise the same kernel's call over the dequantized pages."""
    case = make_case([4096, 1000, 2047, 33, 3000, 1], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, seed=16)
    modes = [DENSE, DISCOVER, DISCOVER_UNION, SPARSE, DISCOVER, SPARSE]
    out = assert_fp8_is_the_dequantized_call(case, modes, random_support(case, 0.2, seed=17),
                                             case.workspace(config=config_for(head_dim, dtype, "fp8")))
    assert not out.isnan().any()


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture_and_replay():
    case = make_case([3000, 1500, 800, 2048], heads=16, kv_heads=16, head_dim=128, page_size=128,
                     dtype=torch.bfloat16, seed=14)
    modes = torch.tensor([DISCOVER, SPARSE, DISCOVER_UNION, DENSE], dtype=torch.int32, device=DEVICE)
    ws = case.workspace(config=None)
    support = random_support(case, 0.2, seed=15)
    static_q = case.q.clone()

    def step():   # validate=False: a validated call reads its values on the host, which a capture forbids
        return decode_attention(static_q, case.k_pages, case.v_pages, case.page_table, case.seq_lens, modes,
                                support, block_size=BLOCK, eta=ETA, workspace=ws, validate=False)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = step()
    for seed in (16, 17):
        fresh_q = 3 * torch.randn(case.q.shape, generator=torch.Generator().manual_seed(seed)).to(case.q)
        start = random_support(case, 0.2, seed=seed)
        static_q.copy_(fresh_q)
        support.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        replayed, replayed_support = out.clone(), support.clone()
        support.copy_(start)
        eager, eager_support = decode_attention(fresh_q, case.k_pages, case.v_pages, case.page_table,
                                                case.seq_lens, modes, support, block_size=BLOCK, eta=ETA)
        assert torch.equal(replayed, eager)
        assert torch.equal(replayed_support, eager_support)
