"""wise_torch.verification: a run of queries per row against the paged cache, causally; the
reference against prefill attention over the gathered keys, the Triton kernel against the
reference (on CUDA when there is one, else in the Triton interpreter; fp32 here: the
interpreter's bf16 dots are not the GPU's, bf16 is checked by the gpu tests)."""

import dataclasses
import functools

import numpy as np
import pytest
import torch

from cases import held_slots
from wise_core import rounding, split_plan
from wise_torch.attention import prefill_attention
from wise_torch.kernels.triton_verify import KernelConfig, VerifyWorkspace, verify_attention
from wise_torch.verification import prepare_verify_attention, verify_attention_reference

pytestmark = pytest.mark.cuda   # on the GPU when there is one (the gpu suite runs it there)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_problem(heads, kv_heads, head_dim, page, n, starts, max_pages=4, num_pages=12, seed=0,
                  dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_pages, page, kv_heads, head_dim, generator=g, dtype=dtype) for _ in range(2))
    table = torch.stack([torch.randperm(num_pages, generator=g)[:max_pages] for _ in starts]).int()
    q = torch.randn(len(starts), n, heads, head_dim, generator=g, dtype=dtype)
    return tuple(t.to(DEVICE) for t in (q, k, v, table, torch.tensor(starts, dtype=torch.int32)))


def test_reference_is_causal_prefill_over_the_rows_keys():
    q, k, v, table, starts = paged_problem(4, 2, 16, 32, 5, [0, 37, 90])
    out = verify_attention_reference(q, k, v, table, starts)
    for b, start in enumerate(starts.tolist()):
        keys = k[table[b].long()].flatten(0, 1)[:start + 5][None]
        values = v[table[b].long()].flatten(0, 1)[:start + 5][None]
        want = prefill_attention(q[b:b + 1], keys, values, start=start)[0]
        torch.testing.assert_close(out[b], want, atol=1e-5, rtol=0)   # fp32, another summation order


@pytest.mark.parametrize("heads,kv_heads,head_dim,page,n,min_splits", [
    (4, 2, 32, 32, 5, 1),      # GQA, one split per 32 keys
    (2, 2, 64, 64, 3, 4),      # MHA, splits shrunk to fill the grid
    (4, 1, 16, 32, 2, 2),      # 4 query heads per KV head
    (2, 2, 96, 32, 3, 1),      # huginn-0125's head_dim (MHA): 128-lane tiles, the padded lanes masked
    (4, 2, 48, 32, 2, 2),      # GQA, 64-lane tiles
])
def test_triton_matches_reference(heads, kv_heads, head_dim, page, n, min_splits):
    max_keys = 4 * page
    # A row from 0, one across pages, one whose last queries pass the table's capacity.
    q, k, v, table, starts = paged_problem(heads, kv_heads, head_dim, page, n, [0, page + 7, max_keys - n + 1])
    config = KernelConfig(tile_n=16, split_keys=32, min_splits=min_splits)
    workspace = VerifyWorkspace.allocate(4, n, heads, head_dim, max_keys, dtype=q.dtype, device=DEVICE,
                                         config=config)
    workspace.out.fill_(float("nan"))
    out = verify_attention(q, k, v, table, starts, workspace=workspace)
    want = verify_attention_reference(q, k, v, table, starts)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)   # fp32, another summation order over <= 256 keys
    assert torch.isnan(workspace.out[3]).all(), "stored past the batch's outputs (a lane past head_dim?)"


def test_nan_past_a_querys_keys_never_reaches_it():
    """A round that wrote its rows' first two positions (one draft; the later queries pad): the
    slots past them hold NaN (a reused page, the scratch page). Queries 0 and 1 read none of it:
    their outputs are bitwise those over finite slots there, in the Triton kernel (whose dot
    reads every key of the round) and the reference."""
    n, page = 4, 32
    q, k, v, table, starts = paged_problem(4, 2, 32, page, n, [0, page - 2, 70])
    held = torch.from_numpy(held_slots(table.cpu(), starts.cpu() + 2, k.shape[0], page)).to(DEVICE)
    bad_k, bad_v = (x.masked_fill(~held[..., None, None], float("nan")) for x in (k, v))
    config = KernelConfig(tile_n=16, split_keys=32)
    for attention in (functools.partial(verify_attention, workspace=VerifyWorkspace.allocate(
            3, n, 4, 32, 4 * page, dtype=q.dtype, device=DEVICE, config=config)), verify_attention_reference):
        want = attention(q, k, v, table, starts)[:, :2].clone()
        got = attention(q, bad_k, bad_v, table, starts)[:, :2]
        assert torch.equal(got, want)


def test_triton_splits_are_the_split_plans():
    """Rows the plan splits evenly where split_keys a split would leave a short last one (80
    keys at up to 64 a split, tiles of 16: 48 + 32, not 64 + 16; 72 keys: 48 + 24, not 64 + 8):
    each split's running max in the workspace is the max score over the plan's keys that the
    query attends, and the output is the reference's."""
    heads, kv_heads, head_dim, page, n = 2, 1, 16, 32, 2
    q, k, v, table, starts = paged_problem(heads, kv_heads, head_dim, page, n, [78, 70, 30], seed=3)
    config = KernelConfig(tile_n=16, split_keys=64)
    workspace = VerifyWorkspace.allocate(3, n, heads, head_dim, 4 * page, dtype=q.dtype, device=DEVICE,
                                         config=config)
    workspace.part_m.fill_(float("nan"))
    out = verify_attention(q, k, v, table, starts, workspace=workspace)
    torch.testing.assert_close(out, verify_attention_reference(q, k, v, table, starts),
                               atol=1e-5, rtol=0)  # fp32, another summation order over <= 128 keys
    part_m = workspace.part_m.cpu().numpy().astype(np.float64)
    base2 = np.log2(np.e) / np.sqrt(head_dim)
    moved = False
    for b, start in enumerate(starts.tolist()):
        keys = k[table[b].long()].flatten(0, 1)[:start + n, 0].double().cpu().numpy()  # [n_keys, head_dim]
        plan = split_plan.split_plan(start + n, tile_n=16, split_keys=64)
        for qi in range(n):
            for h in range(heads):
                query = q[b, qi, h].double().cpu().numpy()
                scores = (keys @ query * base2)[:start + qi + 1]  # the keys the query attends
                # float32 scores: rounding.score_error of scale |q| max |k| (Cauchy-Schwarz), base 2
                bound = np.log2(np.e) * rounding.score_error(
                    np.linalg.norm(query) * np.linalg.norm(keys, axis=1).max() / np.sqrt(head_dim), head_dim)
                got = part_m[b * n + qi, h]
                for s, (lo, hi) in enumerate(plan):
                    assert abs(got[s] - scores[lo:hi].max()) <= bound, (b, qi, h, s)
                    moved |= abs(scores[s * 64:(s + 1) * 64].max() - scores[lo:hi].max()) > bound
                assert np.isnan(got[len(plan):]).all(), f"row {b} ran more splits than the plan's"
    assert moved, "the check should tell the plan's splits from the former ones"


def test_prepared_per_batch_share_one_workspace():
    prepared = prepare_verify_attention("triton", batches=[1, 2, 4], queries=3, heads=2, kv_heads=2, head_dim=16,
                                        max_keys=128, dtype=torch.float32, device=DEVICE, min_splits=lambda b: 8 // b)
    spaces = {b: fn.keywords["workspace"] for b, fn in prepared.items()}
    assert len({id(ws.out) for ws in spaces.values()}) == 1
    assert [spaces[b].config.min_splits for b in (1, 2, 4)] == [8, 4, 2]
    q, k, v, table, starts = paged_problem(2, 2, 16, 32, 3, [5, 60])
    torch.testing.assert_close(prepared[2](q, k, v, table, starts), verify_attention_reference(q, k, v, table, starts),
                               atol=1e-5, rtol=0)  # fp32, another summation order over <= 256 keys
    assert prepare_verify_attention("reference", batches=[1, 2], queries=3, heads=2, kv_heads=2, head_dim=16,
                                    max_keys=128, dtype=torch.float32, device=DEVICE) == {
        1: verify_attention_reference, 2: verify_attention_reference}


def test_bad_arguments_are_named():
    q, k, v, table, starts = paged_problem(4, 2, 16, 32, 3, [0, 5])
    with pytest.raises(ValueError, match=r"q must be \[batch, n, heads, head_dim\]"):
        verify_attention_reference(q[0], k, v, table, starts)
    with pytest.raises(ValueError, match="starts must be int32"):
        verify_attention_reference(q, k, v, table, starts.long())
    with pytest.raises(ValueError, match="page_table must be int32"):
        verify_attention_reference(q, k, v, table[:1], starts)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        verify_attention_reference(q[:, :, :3], k, v, table, starts)
    workspace = VerifyWorkspace.allocate(2, 4, 4, 16, 128, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="allocated for queries=4, the call has 3"):
        verify_attention(q, k, v, table, starts, workspace=workspace)
    small = dataclasses.replace(workspace, out=workspace.out[:1, :3])
    with pytest.raises(ValueError, match="batch 2 exceeds the workspace's max_batch 1"):
        verify_attention(q, k, v, table, starts, workspace=small)
    q, k, v, table, starts = paged_problem(4, 2, 40, 32, 3, [0, 5])
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16 .* got 40"):
        verify_attention(q, k, v, table, starts)
