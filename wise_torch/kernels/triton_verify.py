"""Split-KV paged verification attention in Triton (`wise_torch.verification`'s contract).

n queries per row at positions starts[b] .. starts[b] + n - 1, each attending its row's keys up
to itself. Two launches per call, as the decode kernel (`triton_decode`):

1. Split kernel, program (row, kv_head, split) of the grid [batch * kv_heads, max_splits]: the
   split's keys [lo, hi) of the row (keys 0 .. starts + n - 1, cut by `wise_core.split_plan` in
   keys: the fewest splits of at most `split_keys`, more for a short row given `min_splits`, as
   even as whole tiles allow), `tile_n` keys per iteration, read once for every
   (query, head) of the KV group: the query tile is [n * group (padded), head_dim], so the
   scores are one tensor-core dot. Query i masks keys past starts + i, and reads no value past
   them (a stale NaN there would reach it as 0 x NaN): the dot takes the values of the keys up
   to starts, which every query reads, and those of the round's later keys go in per query.
   Online softmax in base 2; each split stores (acc, max, sum) per (query, head).
2. Finish kernel, program (row, query, head): merges the row's splits in split order
   (`triton_splits.merge_splits`, the decode kernel's merge).
head_dim: any multiple of 16, tiles the next power of two wide (`triton_head_dim`).
A split entirely past a query's last key leaves it (0, -inf, 0), which the merge ignores; key 0
is in the first split, so every query attends at least one key.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from wise_core import split_plan
from wise_torch.kernels import triton_head_dim
from wise_torch.kernels.triton_head_dim import lanes, store_lanes
from wise_torch.kernels.triton_splits import check_launch, merge_splits, splits
from wise_torch.verify_check import check_verify_args


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape: keys per loop iteration, keys per program (bounds its work), warps, stages,
    and the fewest splits a row gets (to fill the GPU when batches are small)."""

    tile_n: int = 64
    split_keys: int = 512
    num_warps: int = 4
    num_stages: int = 2
    min_splits: int = 1

    def __post_init__(self) -> None:
        check_launch(self)


# Fixed launch configurations (no autotuning: a verification pass runs inside a CUDA graph).
CONFIGS: dict[tuple[int, torch.dtype], KernelConfig] = {
    (128, torch.bfloat16): KernelConfig(tile_n=64, split_keys=512, num_warps=4, num_stages=3),
    (128, torch.float16): KernelConfig(tile_n=64, split_keys=512, num_warps=4, num_stages=3),
    (128, torch.float32): KernelConfig(tile_n=32, split_keys=256, num_warps=4, num_stages=2),
}


def config_for(head_dim: int, dtype: torch.dtype) -> KernelConfig:
    """The table's configuration for (head_dim, dtype); KernelConfig() for others. A head_dim
    that is not a power of two (96) runs its tiles' width's entry (`triton_head_dim.block_d`),
    not tuned on a GPU."""
    return CONFIGS.get((triton_head_dim.block_d(head_dim), dtype), KernelConfig())


def max_splits(config: KernelConfig, max_keys: int) -> int:
    """Most splits of a row of max_keys keys (`wise_core.split_plan` in keys): the grid's split axis."""
    return split_plan.max_splits(max_keys, tile=config.tile_n, split=config.split_keys,
                                 min_splits=config.min_splits)


@dataclasses.dataclass(frozen=True)
class VerifyWorkspace:
    """Buffers of `verify_attention`, preallocated so a call allocates nothing and never syncs:
    calls of up to `max_batch` rows of `queries` queries and `max_keys` keys per row. The output
    is a view of `out`, overwritten by the next call; calls sharing it run in stream order."""

    config: KernelConfig
    out: torch.Tensor       # [max_batch, queries, heads, head_dim], q's dtype
    part_acc: torch.Tensor  # float32[max_batch * queries, heads, max_splits, block_d(head_dim)]
    part_m: torch.Tensor    # float32[max_batch * queries, heads, max_splits]: max score (base 2)
    part_l: torch.Tensor    # float32[max_batch * queries, heads, max_splits]: sum of exponentials

    @classmethod
    def allocate(cls, max_batch: int, queries: int, heads: int, head_dim: int, max_keys: int, *,
                 dtype: torch.dtype, device: torch.device | str,
                 config: KernelConfig | None = None) -> "VerifyWorkspace":
        for name, value in (("max_batch", max_batch), ("queries", queries), ("heads", heads),
                            ("head_dim", head_dim), ("max_keys", max_keys)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"VerifyWorkspace.{name} must be a positive integer, got {value!r}")
        config = config_for(head_dim, dtype) if config is None else config
        grid_splits = max_splits(config, max_keys)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(config=config, out=torch.empty(max_batch, queries, heads, head_dim, dtype=dtype, device=device),
                   part_acc=torch.zeros(max_batch * queries, heads, grid_splits,
                                        triton_head_dim.block_d(head_dim), **f32),
                   part_m=torch.zeros(max_batch * queries, heads, grid_splits, **f32),
                   part_l=torch.zeros(max_batch * queries, heads, grid_splits, **f32))

    @property
    def num_splits(self) -> int:
        return self.part_m.shape[2]

    def check_fits(self, q: torch.Tensor, max_keys: int) -> None:
        """Raise ValueError if a call with this q and max_keys keys per row does not fit."""
        batch, n, heads, head_dim = q.shape
        max_batch, queries, ws_heads, ws_dim = self.out.shape
        wanted = {"queries": (n, queries), "heads": (heads, ws_heads), "head_dim": (head_dim, ws_dim),
                  "dtype": (q.dtype, self.out.dtype), "device": (q.device, self.out.device)}
        for name, (got, have) in wanted.items():
            if got != have:
                raise ValueError(f"the workspace was allocated for {name}={have}, the call has {got}")
        if batch > max_batch:
            raise ValueError(f"batch {batch} exceeds the workspace's max_batch {max_batch}")
        if max_splits(self.config, max_keys) > self.num_splits:
            raise ValueError(f"{max_keys} keys per row need more splits than the workspace holds")


@triton.jit
def _split_kernel(
        q_ptr, k_ptr, v_ptr, page_table_ptr, starts_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
        kv_heads, max_keys, qk_scale,
        stride_qb, stride_qn, stride_qh, stride_kp, stride_kt, stride_kh, stride_pt, ws_splits,
        N_Q: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr, SPLIT_KEYS: tl.constexpr,
        MIN_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Step 1 of the module docstring for program (row * kv_heads + kv_head, split)."""
    row = tl.program_id(0) // kv_heads
    kvh = tl.program_id(0) % kv_heads
    split = tl.program_id(1)
    heads = kv_heads * GROUP
    start = tl.load(starts_ptr + row)
    n_keys = tl.minimum(start + N_Q, max_keys)
    split_keys, _ = splits(n_keys, TILE_N, SPLIT_KEYS, MIN_SPLITS)
    lo = split * split_keys
    if lo >= n_keys:
        return
    hi = tl.minimum(lo + split_keys, n_keys)

    m = tl.arange(0, BLOCK_M)          # tile row: query m // GROUP, head kvh * GROUP + m % GROUP
    m_ok = m < N_Q * GROUP
    qi = m // GROUP
    head = kvh * GROUP + m % GROUP
    offs_d = tl.arange(0, BLOCK_D)  # head_dim's lanes, padded to a power of two (triton_head_dim)
    q = tl.load(q_ptr + row * stride_qb + qi[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=lanes(m_ok[:, None], offs_d[None, :], HEAD_DIM, BLOCK_D), other=0.0)  # [BLOCK_M, D]
    last = start + qi                                                            # the query's last key

    offs_n = tl.arange(0, TILE_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t in range(lo, hi, TILE_N):
        key = t + offs_n
        key_ok = key < hi
        page = tl.load(page_table_ptr + row * stride_pt + key // PAGE, mask=key_ok, other=0)
        base = page.to(tl.int64) * stride_kp + (key % PAGE).to(tl.int64) * stride_kt + kvh * stride_kh
        kv = base[:, None] + offs_d[None, :]
        kv_ok = lanes(key_ok[:, None], offs_d[None, :], HEAD_DIM, BLOCK_D)
        k = tl.load(k_ptr + kv, mask=kv_ok, other=0.0)                           # [TILE_N, D]
        v = tl.load(v_ptr + kv, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # [BLOCK_M, TILE_N]
        s = tl.where(key_ok[None, :] & (key[None, :] <= last[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # Every query reads the keys up to `start`; a later key is query i's only from start + i
        # on, and its value goes in per query: p is 0 for the others, but 0 x v in the dot is
        # NaN where the slot is (a position this round did not write holds its last holder's).
        v_all = tl.where((key <= start)[:, None], v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v_all, input_precision=DOT_PRECISION)
        if t + TILE_N > start + 1:
            for j in tl.static_range(1, N_Q):
                at = offs_n == start + j - t                                     # key start + j's column
                p_j = tl.sum(tl.where(at[None, :], p, 0.0), 1)                   # [BLOCK_M]
                v_j = tl.sum(tl.where(at[:, None], v, 0.0), 0).to(tl.float32)    # [D]
                acc += tl.where((qi >= j)[:, None], p_j[:, None] * v_j[None, :], 0.0)
        m_i = m_new

    part = ((row * N_Q + qi) * heads + head) * ws_splits + split                 # [BLOCK_M]
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=m_ok[:, None])
    tl.store(part_m_ptr + part, m_i, mask=m_ok)
    tl.store(part_l_ptr + part, l_i, mask=m_ok)


@triton.jit
def _finish_kernel(
        starts_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, heads, max_keys,
        stride_ob, stride_on, stride_oh, ws_splits,
        N_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
        SPLIT_KEYS: tl.constexpr, MIN_SPLITS: tl.constexpr, S_CHUNK: tl.constexpr):
    """Step 2 of the module docstring for program ((row * N_Q + query) * heads + head)."""
    pid = tl.program_id(0)
    head = pid % heads
    qi = (pid // heads) % N_Q
    row = pid // (heads * N_Q)
    start = tl.load(starts_ptr + row)
    n_keys = tl.minimum(start + N_Q, max_keys)
    _, n_splits = splits(n_keys, TILE_N, SPLIT_KEYS, MIN_SPLITS)
    acc, _, l_run = merge_splits(part_acc_ptr, part_m_ptr, part_l_ptr, pid * ws_splits, n_splits, BLOCK_D, S_CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    store_lanes(out_ptr + row * stride_ob + qi * stride_on + head * stride_oh + offs_d,
                (acc / l_run).to(out_ptr.dtype.element_ty), offs_d, HEAD_DIM, BLOCK_D)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_kernel_inputs(q, k_pages, v_pages, page_table, starts) -> None:
    """Kernel-specific checks on top of `check_verify_args` (no host sync)."""
    check_verify_args(q, k_pages, v_pages, page_table, starts)
    if q.dtype not in _DTYPES or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"q, k_pages and v_pages must share one dtype of {_DTYPES}, got "
                         f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    triton_head_dim.check(q.shape[3])
    devices = {t.device for t in (q, k_pages, v_pages, page_table, starts)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if q.stride(3) != 1 or k_pages.stride(3) != 1 or k_pages.stride() != v_pages.stride():
        raise ValueError("q and the pages must be contiguous in head_dim, k_pages and v_pages share strides")
    if page_table.stride(1) != 1 or not starts.is_contiguous():
        raise ValueError("page_table must be contiguous in pages and starts contiguous")


def verify_attention(q, k_pages, v_pages, page_table, starts, *, scale: float | None = None,
                     workspace: VerifyWorkspace | None = None):
    """`wise_torch.verification`'s contract. With a `workspace` the call allocates nothing and
    does not sync (CUDA-graph capturable); the output is then a view of the workspace."""
    _check_kernel_inputs(q, k_pages, v_pages, page_table, starts)
    batch, n, heads, head_dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    max_keys = page_table.shape[1] * page_size
    if workspace is None:
        workspace = VerifyWorkspace.allocate(max(batch, 1), n, heads, head_dim, max_keys, dtype=q.dtype,
                                             device=q.device)
    workspace.check_fits(q, max_keys)
    out = workspace.out[:batch]
    if batch == 0:
        return out
    ws, config = workspace, workspace.config
    group = heads // kv_heads
    grid_splits = max_splits(config, max_keys)
    scale = head_dim ** -0.5 if scale is None else scale
    block_d = triton_head_dim.block_d(head_dim)
    _split_kernel[(batch * kv_heads, grid_splits)](
        q, k_pages, v_pages, page_table, starts, ws.part_acc, ws.part_m, ws.part_l,
        kv_heads, max_keys, scale * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        page_table.stride(0), ws.num_splits,
        N_Q=n, GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(n * group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page_size, TILE_N=config.tile_n, SPLIT_KEYS=config.split_keys, MIN_SPLITS=config.min_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages)
    _finish_kernel[(batch * n * heads,)](
        starts, out, ws.part_acc, ws.part_m, ws.part_l, heads, max_keys,
        out.stride(0), out.stride(1), out.stride(2), ws.num_splits,
        N_Q=n, HEAD_DIM=head_dim, BLOCK_D=block_d, TILE_N=config.tile_n, SPLIT_KEYS=config.split_keys,
        MIN_SPLITS=config.min_splits, S_CHUNK=min(16, triton.next_power_of_2(grid_splits)), num_warps=4, num_stages=1)
    return out
