"""Split-KV paged decode attention in Triton, with per-row WISE modes (docs/DESIGN.md).

Two launches per call. Split kernel: program (row, kv_head, split) of the grid
[batch * kv_heads, max_splits] does steps 1 and 2; finish kernel: program (row, head) of the grid
[batch * heads] does step 3.

1. List. The row's attended blocks are every causal block (DENSE, DISCOVER, DISCOVER_UNION) or
   the causal blocks selected by some query head of the KV group (SPARSE), numbered by a prefix
   sum over the bits. `wise_core.split_plan` cuts the list by its length alone (the fewest
   splits of at most `split_keys` keys, as even as whole tiles allow): split s owns entries
   [s * size, (s + 1) * size) and writes their first-key cache offsets to the workspace. A
   dense row's list is 0, 1, 2, ...; a sparse row selecting every causal block has the very
   same list, so the same splits and the same accumulation order: the two are bitwise equal
   by construction.
2. Attend. Loop over the split's entries, `tile_n` keys per iteration, online softmax in base 2
   for all query heads of the group at once (GQA: tensor-core dots; MHA: a reduction). Sparse
   GQA rows mask the blocks a head did not select. Discovery rows also store, per block, its
   sum of exponentials and the running max that sum is relative to; the output math is the
   dense path's, so DISCOVER and DISCOVER_UNION outputs are bitwise DENSE.
3. Finish. Each split stores (acc, max, sum). The finish kernel counts the row's splits as
   step 1 does, merges them in split order, writes the output and, for discovery rows, turns
   the block stats into block mass and applies `wise_core.reference.select_blocks` (sort by
   mass, prefix sum, threshold), writing the support in place.
head_dim: any multiple of 16 (huginn-0125's 96): tiles along it are the next power of two wide,
padded lanes load 0 and store nothing (`triton_head_dim`); a power-of-two head_dim runs unpadded.
A program attends at most `split_keys` keys, so a long dense row costs more programs, not longer
ones, and the sparse rows of a mixed batch are not paced by its longest dense row. The merge
runs in its own launch (the launch boundary orders it after every split, no atomics), which
keeps the selection's sort out of the split kernel's register budget.

fp8 pages (k_scale, v_scale given: an fp8 cache's, `wise_torch.kv_cache`): k_pages and v_pages
are uint8 e4m3fn codes and each key's K and V carry one float32 scale per KV head. A tile's
codes are loaded as bytes, bitcast to float8e4nv, widened to float32, multiplied by their scale
and rounded to q's dtype in registers -- `wise_core.kv_quant.dequantize`'s arithmetic, so the
tile holds bitwise the values the reference dequantizes, and the rest of the kernel runs
unchanged: its output, mass and selection on fp8 pages are bitwise those on the dequantized
pages. A key's scale sits at its code offset / head_dim (codes and scales both contiguous: a
cache plane's layout). Launches over fp8 pages take `config_for(..., "fp8")` (at most
FP8_MAX_STAGES pipeline stages). The engine does not run this path yet
(`attention.resolve_kernel` refuses kernel="triton" for an fp8 pool): it has run in the
interpreter and been compiled offline for sm90, not yet run on a GPU.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from wise_core import modes as M
from wise_core import split_plan
from wise_torch.decode_check import check_call
from wise_torch.kernels import triton_head_dim
from wise_torch.kernels.triton_head_dim import lanes, store_lanes
from wise_torch.kernels.triton_splits import check_launch, merge_splits, splits

_DISCOVER = tl.constexpr(M.DISCOVER)
_DISCOVER_UNION = tl.constexpr(M.DISCOVER_UNION)
_SPARSE = tl.constexpr(M.SPARSE)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape: keys per loop iteration, keys per program (bounds its work), warps, stages."""

    tile_n: int = 64
    split_keys: int = 512
    num_warps: int = 4
    num_stages: int = 2
    mha_dots: bool = False  # MHA too on tensor-core dots (query-head axis padded to 16)
    # A row listing few blocks (short or sparse) still gets up to min_splits programs: its
    # splits shrink to whole tiles. Depends on the row's block count only, so the bitwise
    # equalities (sparse with every block == dense, a row in a batch == alone) still hold.
    min_splits: int = 1

    def __post_init__(self) -> None:
        check_launch(self)


# Fixed launch configurations (no autotuning: a decode step must be capturable in a CUDA graph).
# About 16 KB of K (and of V) per iteration, 8 iterations per program. 16-bit head_dim 128: the
# fastest of the H200 sweep (tensor-core dots even for MHA, three stages of loads in flight).
CONFIGS: dict[tuple[int, torch.dtype], KernelConfig] = {
    (128, torch.bfloat16): KernelConfig(tile_n=64, split_keys=512, num_warps=4, num_stages=3, mha_dots=True),
    (128, torch.float16): KernelConfig(tile_n=64, split_keys=512, num_warps=4, num_stages=3, mha_dots=True),
    (128, torch.float32): KernelConfig(tile_n=32, split_keys=256, num_warps=4, num_stages=2),
    (64, torch.bfloat16): KernelConfig(tile_n=128, split_keys=1024, num_warps=4, num_stages=2),
    (64, torch.float16): KernelConfig(tile_n=128, split_keys=1024, num_warps=4, num_stages=2),
    (64, torch.float32): KernelConfig(tile_n=64, split_keys=512, num_warps=4, num_stages=2),
}


# fp8 pages: the tiles are dequantized in registers, and Triton cannot pipeline one-byte loads
# over three stages on sm90 (its cp.async needs 4 bytes a copy): 16-bit head_dim 128 takes 8
# warps and 2 stages (no spill in the sm90 offline compile; 4 warps spill), other entries their
# table's configuration at 2 stages at most. Not tuned on a GPU.
FP8_MAX_STAGES = 2
FP8_CONFIGS: dict[tuple[int, torch.dtype], KernelConfig] = {
    (128, torch.bfloat16): KernelConfig(tile_n=64, split_keys=512, num_warps=8, num_stages=2, mha_dots=True),
    (128, torch.float16): KernelConfig(tile_n=64, split_keys=512, num_warps=8, num_stages=2, mha_dots=True),
}


def config_for(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KernelConfig:
    """The table's configuration for (head_dim, dtype); KernelConfig() for other head dims. A
    head_dim that is not a power of two (huginn-0125's 96) runs its tiles' width's entry
    (`triton_head_dim.block_d`: 128 for 96), its tiles being that wide: not tuned on a GPU.
    kv_cache_dtype "fp8": `FP8_CONFIGS`' entry, else the table's at FP8_MAX_STAGES stages at most."""
    key = (triton_head_dim.block_d(head_dim), dtype)
    config = CONFIGS.get(key, KernelConfig())
    if kv_cache_dtype != "fp8":
        return config
    return FP8_CONFIGS.get(key, dataclasses.replace(config, num_stages=min(config.num_stages, FP8_MAX_STAGES)))


def split_rule(config: KernelConfig, block_size: int) -> dict:
    """The launch's split plan in blocks (`wise_core.split_plan`): tile, split, min_splits."""
    tile, split = split_plan.split_units(block_size, config.tile_n, config.split_keys)
    return dict(tile=tile, split=split, min_splits=config.min_splits)


def _max_splits(config: KernelConfig, block_size: int, max_blocks: int) -> int:
    """Most splits of a row of max_blocks blocks: the grid's split axis."""
    return split_plan.max_splits(max_blocks, **split_rule(config, block_size))


@dataclasses.dataclass(frozen=True)
class DecodeWorkspace:
    """Buffers of `decode_attention`, preallocated so a call allocates nothing and never syncs.

    Sized for up to `max_batch` rows and `max_blocks` blocks per row. The returned output (and
    mass) are views of `out` (and `mass`), overwritten by the next call using this workspace;
    calls sharing a workspace must run in stream order.
    """

    config: KernelConfig
    block_size: int
    out: torch.Tensor       # [max_batch, heads, head_dim], q's dtype
    mass: torch.Tensor      # float32[max_batch, heads, max_blocks]
    starts: torch.Tensor    # int64[max_batch, kv_heads, max_blocks]: block list, first-key cache offsets
    blocks: torch.Tensor    # int32[max_batch, kv_heads, max_blocks]: block list, block indices
    part_acc: torch.Tensor  # float32[max_batch, heads, max_splits, block_d(head_dim)]: per-split unnormalised outputs
    part_m: torch.Tensor    # float32[max_batch, heads, max_splits]: per-split max score (base 2)
    part_l: torch.Tensor    # float32[max_batch, heads, max_splits]: per-split sum of exponentials
    stat_m: torch.Tensor    # float32[max_batch, heads, max_blocks]: block stats, reference max
    stat_l: torch.Tensor    # float32[max_batch, heads, max_blocks]: block stats, sum of exponentials

    @classmethod
    def allocate(cls, max_batch: int, heads: int, kv_heads: int, head_dim: int, max_blocks: int, *,
                 dtype: torch.dtype, device: torch.device | str, block_size: int = 32,
                 config: KernelConfig | None = None) -> "DecodeWorkspace":
        """Workspace for calls with q: [<= max_batch, heads, head_dim] of `dtype` on `device`."""
        for name, value in (("max_batch", max_batch), ("heads", heads), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("max_blocks", max_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeWorkspace.{name} must be a positive integer, got {value!r}")
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
        config = config_for(head_dim, dtype) if config is None else config
        max_splits = _max_splits(config, block_size, max_blocks)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            config=config, block_size=block_size,
            out=torch.empty(max_batch, heads, head_dim, dtype=dtype, device=device),
            mass=torch.zeros(max_batch, heads, max_blocks, **f32),
            starts=torch.zeros(max_batch, kv_heads, max_blocks, dtype=torch.int64, device=device),
            blocks=torch.zeros(max_batch, kv_heads, max_blocks, dtype=torch.int32, device=device),
            part_acc=torch.zeros(max_batch, heads, max_splits, triton_head_dim.block_d(head_dim), **f32),
            part_m=torch.zeros(max_batch, heads, max_splits, **f32),
            part_l=torch.zeros(max_batch, heads, max_splits, **f32),
            stat_m=torch.zeros(max_batch, heads, max_blocks, **f32),
            stat_l=torch.zeros(max_batch, heads, max_blocks, **f32))

    @property
    def max_blocks(self) -> int:
        return self.mass.shape[2]

    @property
    def max_splits(self) -> int:
        return self.part_m.shape[2]

    def check_fits(self, batch: int, heads: int, kv_heads: int, head_dim: int, max_blocks: int,
                   block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raise ValueError if a call of these dimensions does not fit this workspace."""
        max_batch, ws_heads, ws_dim = self.out.shape
        wanted = {"heads": (heads, ws_heads), "kv_heads": (kv_heads, self.starts.shape[1]),
                  "head_dim": (head_dim, ws_dim), "block_size": (block_size, self.block_size),
                  "dtype": (dtype, self.out.dtype), "device": (device, self.out.device)}
        for name, (got, have) in wanted.items():
            if got != have:
                raise ValueError(f"the workspace was allocated for {name}={have}, the call has {got}")
        if batch > max_batch:
            raise ValueError(f"batch {batch} exceeds the workspace's max_batch {max_batch}")
        if max_blocks > self.max_blocks:
            raise ValueError(f"{max_blocks} blocks per row exceed the workspace's max_blocks {self.max_blocks}")
        if _max_splits(self.config, block_size, max_blocks) > self.max_splits:
            raise ValueError(f"{max_blocks} blocks per row need more splits than the workspace's {self.max_splits}")


@triton.jit
def _scores(q, k, BLOCK_G: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q: [BLOCK_G, D], k: [TILE_N, D] -> k q^T, float32 [TILE_N, BLOCK_G]."""
    if BLOCK_G == 1:
        return tl.sum(k.to(tl.float32) * q.to(tl.float32), 1, keep_dims=True)
    else:
        return tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)


@triton.jit
def _weighted_values(p, v, BLOCK_G: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """p: float32 [TILE_N, BLOCK_G], v: [TILE_N, D] -> p^T v, float32 [BLOCK_G, D]."""
    if BLOCK_G == 1:
        return tl.sum(p * v.to(tl.float32), 0, keep_dims=True)
    else:
        return tl.dot(tl.trans(p.to(v.dtype)), v, input_precision=DOT_PRECISION)


@triton.jit
def _as_rows(x, BLOCK_G: tl.constexpr):
    """Per-head values [1, BLOCK_G] -> [BLOCK_G, 1], to scale the rows of [BLOCK_G, D]."""
    if BLOCK_G == 1:
        return x
    else:
        return tl.trans(x)


@triton.jit
def _select_ranked(mass, eta, NB_PAD: tl.constexpr):
    """mass: float32 [NB_PAD] >= 0 -> (block index, kept), both in rank order.

    Rank: mass descending, ties to the lower index. Kept: rank r with r == 0 or running[r - 1]
    < eta * total, i.e. r <= #{r' : running[r'] < eta * total} (running is non-decreasing).
    """
    idx = tl.arange(0, NB_PAD)
    key = (mass.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (NB_PAD - 1 - idx).to(tl.int64)
    key = tl.sort(key, descending=True)
    order = NB_PAD - 1 - (key & 0xFFFFFFFF).to(tl.int32)
    running = tl.cumsum((key >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0)
    total = tl.sum(tl.where(idx == NB_PAD - 1, running, 0.0), 0)
    below = tl.sum((running < eta * total).to(tl.int32), 0)
    return order, idx <= below


@triton.jit
def _finish_head(row, head, heads, mode, n_splits, n_causal, max_blocks, eta,
                 out_ptr, mass_ptr, support_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                 stat_m_ptr, stat_l_ptr,
                 stride_ob, stride_oh, stride_mb, stride_mh, stride_sb, stride_sh,
                 ws_blocks, ws_splits,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, S_CHUNK: tl.constexpr, NB_PAD: tl.constexpr,
                 RETURN_MASS: tl.constexpr, SELECT: tl.constexpr):
    """Merge one head's splits in split order; discovery rows: block mass and selection (not
    compiled without SELECT: a reuse call, where no row discovers)."""
    offs_d = tl.arange(0, BLOCK_D)
    acc, m_run, l_run = merge_splits(part_acc_ptr, part_m_ptr, part_l_ptr, (row * heads + head) * ws_splits,
                                     n_splits, BLOCK_D, S_CHUNK)
    store_lanes(out_ptr + row * stride_ob + head * stride_oh + offs_d, (acc / l_run).to(out_ptr.dtype.element_ty),
                offs_d, HEAD_DIM, BLOCK_D)

    blk = tl.arange(0, NB_PAD)
    if SELECT:
        is_disc = (mode == _DISCOVER) | (mode == _DISCOVER_UNION)
        has_stat = tl.where(is_disc, blk < n_causal, False)
        stat = (row * heads + head) * ws_blocks + blk
        stat_m = tl.load(stat_m_ptr + stat, mask=has_stat, other=0.0)
        stat_l = tl.load(stat_l_ptr + stat, mask=has_stat, other=0.0)
        mass = tl.where(has_stat, stat_l * tl.exp2(stat_m - m_run) / l_run, 0.0)
        if RETURN_MASS:
            tl.store(mass_ptr + row * stride_mb + head * stride_mh + blk, mass, mask=blk < max_blocks)
        if is_disc:
            order, kept = _select_ranked(mass, eta, NB_PAD)
            dst = support_ptr + row * stride_sb + head * stride_sh + order
            in_row = order < max_blocks
            held = tl.load(dst, mask=tl.where(mode == _DISCOVER_UNION, in_row, False), other=0)
            tl.store(dst, (kept | (held != 0)).to(tl.uint8), mask=in_row)
    elif RETURN_MASS:
        tl.store(mass_ptr + row * stride_mb + head * stride_mh + blk, tl.zeros([NB_PAD], tl.float32),
                 mask=blk < max_blocks)


@triton.jit
def _dequantize(codes, scales, dtype: tl.constexpr):
    """codes uint8 [TILE_N, D], scales float32 [TILE_N] -> values of `dtype` [TILE_N, D]:
    RN_dtype(RN(value(code) * scale)) (`wise_core.kv_quant.dequantize`). Codes 0x7F and 0xFF
    are NaN (the conversion is set explicitly: Triton's interpreter reads them as +-480)."""
    x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    x = tl.where((codes & 0x7F) == 0x7F, float("nan"), x)
    return (x * scales[:, None]).to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _listed_blocks(support_ptr, row, kvh, is_sparse, n_causal, stride_sb, stride_sh,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, NB_PAD: tl.constexpr):
    """bool [NB_PAD]: the blocks the (row, kv_head) attends, every causal block or (SPARSE) the
    causal blocks some query head of the group selected."""
    blk = tl.arange(0, NB_PAD)
    causal = blk < n_causal
    gp = tl.arange(0, GROUP_PAD)  # the group's heads without the dots' padding
    picked = tl.load(support_ptr + row * stride_sb + (kvh * GROUP + gp[:, None]) * stride_sh + blk[None, :],
                     mask=tl.where(is_sparse, (gp[:, None] < GROUP) & causal[None, :], False), other=0)
    return causal & tl.where(is_sparse, tl.max(picked, 0) != 0, True)


@triton.jit
def _split_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, page_table_ptr, seq_lens_ptr, modes_ptr, support_ptr,
        starts_ptr, blocks_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, stat_m_ptr, stat_l_ptr,
        kv_heads, max_blocks, qk_scale,
        stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_pt, stride_sb, stride_sh,
        ws_blocks, ws_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK: tl.constexpr,
        PAGE: tl.constexpr, TILE_N: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, MIN_SPLITS: tl.constexpr,
        NB_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_ALIGN: tl.constexpr, FP8: tl.constexpr):
    """Steps 1 and 2 of the module docstring for program (row * kv_heads + kv_head, split).
    FP8: k_ptr, v_ptr hold uint8 codes, k_scale_ptr, v_scale_ptr their scales (module docstring);
    otherwise the scale pointers are not read."""
    row = tl.program_id(0) // kv_heads
    kvh = tl.program_id(0) % kv_heads
    split = tl.program_id(1)
    heads = kv_heads * GROUP
    mode = tl.load(modes_ptr + row)
    seq_len = tl.load(seq_lens_ptr + row)
    is_sparse = mode == _SPARSE
    is_disc = (mode == _DISCOVER) | (mode == _DISCOVER_UNION)
    n_causal = tl.minimum(tl.cdiv(seq_len, BLOCK), max_blocks)

    # 1. The row's block list; this split's entries [lo, hi) go to the workspace.
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = kvh * GROUP + g
    support_rows = support_ptr + row * stride_sb + head * stride_sh          # [BLOCK_G]
    blk = tl.arange(0, NB_PAD)
    listed = _listed_blocks(support_ptr, row, kvh, is_sparse, n_causal, stride_sb, stride_sh,
                            GROUP, GROUP_PAD, NB_PAD)
    n_listed = tl.sum(listed.to(tl.int32), 0)
    split_blocks, n_splits = splits(n_listed, TILE_N // BLOCK, SPLIT_BLOCKS, MIN_SPLITS)
    if split >= n_splits:
        return
    offs_d = tl.arange(0, BLOCK_D)  # head_dim's lanes, padded to a power of two (triton_head_dim)
    q = tl.load(q_ptr + row * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=lanes(g_ok[:, None], offs_d[None, :], HEAD_DIM, BLOCK_D), other=0.0)  # [BLOCK_G, D]
    rank = tl.cumsum(listed.to(tl.int32), 0) - 1
    lo = split * split_blocks
    hi = tl.minimum(lo + split_blocks, n_listed)
    mine = listed & (rank >= lo) & (rank < hi)
    page = tl.load(page_table_ptr + row * stride_pt + blk * BLOCK // PAGE, mask=mine, other=0)
    start = (page.to(tl.int64) * stride_kp + (blk * BLOCK % PAGE).to(tl.int64) * stride_kt
             + kvh * stride_kh)
    list_base = (row * kv_heads + kvh) * ws_blocks
    tl.store(starts_ptr + list_base + rank, start, mask=mine)
    if GROUP > 1:
        tl.store(blocks_ptr + list_base + rank, blk, mask=mine)
    # Only the last causal block can be partial; when listed, it is the last entry.
    tail_listed = tl.sum(tl.where(blk == n_causal - 1, listed, False).to(tl.int32), 0) > 0
    tail_keys = tl.where(tail_listed, seq_len - (n_causal - 1) * BLOCK, BLOCK)
    tl.debug_barrier()  # a program reads back only the entries it wrote: the barrier suffices

    # 2. Online softmax over the split's entries, TILE_N keys per iteration.
    offs_n = tl.arange(0, TILE_N)
    within = offs_n % BLOCK
    m_i = tl.full([1, BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([1, BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    stats = (row * heads + head[None, :]) * ws_blocks                         # [1, BLOCK_G]
    for t in range(lo, hi, TILE_N // BLOCK):
        entry = t + offs_n // BLOCK
        in_list = entry < hi
        key_start = tl.multiple_of(tl.load(starts_ptr + list_base + entry, mask=in_list, other=0), KV_ALIGN)
        key_ok = in_list & ((entry < n_listed - 1) | (within < tail_keys))
        key = key_start + within.to(tl.int64) * stride_kt                         # [TILE_N]
        kv = key[:, None] + offs_d[None, :]
        kv_ok = lanes(key_ok[:, None], offs_d[None, :], HEAD_DIM, BLOCK_D)
        if FP8:   # codes and a scale per key, dequantized to q's dtype in registers
            k_scale = tl.load(k_scale_ptr + key // HEAD_DIM, mask=key_ok, other=1.0)
            v_scale = tl.load(v_scale_ptr + key // HEAD_DIM, mask=key_ok, other=1.0)
            k = _dequantize(tl.load(k_ptr + kv, mask=kv_ok, other=0), k_scale, q_ptr.dtype.element_ty)
            v = _dequantize(tl.load(v_ptr + kv, mask=kv_ok, other=0), v_scale, q_ptr.dtype.element_ty)
        else:
            k = tl.load(k_ptr + kv, mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + kv, mask=kv_ok, other=0.0)
        s = _scores(q, k, BLOCK_G, DOT_PRECISION) * qk_scale                   # [TILE_N, BLOCK_G]
        keep = key_ok[:, None]
        if GROUP > 1:  # a sparse row lists the union of its heads' blocks; mask per head
            key_blk = tl.load(blocks_ptr + list_base + entry, mask=in_list, other=0)
            chosen = tl.load(support_rows[None, :] + key_blk[:, None],
                             mask=tl.where(is_sparse, key_ok[:, None] & g_ok[None, :], False), other=1)
            keep = keep & (chosen != 0)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0, keep_dims=True))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref)
        l_i = l_i * alpha + tl.sum(p, 0, keep_dims=True)
        acc = acc * _as_rows(alpha, BLOCK_G) + _weighted_values(p, v, BLOCK_G, DOT_PRECISION)
        m_i = m_new
        if is_disc:  # per block: sum of exp2(s - m_ref), relative to m_ref (the list is the block index)
            for j in tl.static_range(TILE_N // BLOCK):
                block_sum = tl.sum(tl.where((offs_n // BLOCK == j)[:, None], p, 0.0), 0, keep_dims=True)
                ok = tl.where(t + j < hi, g_ok[None, :], False)
                tl.store(stat_m_ptr + stats + t + j, m_ref, mask=ok)
                tl.store(stat_l_ptr + stats + t + j, block_sum, mask=ok)

    # This split's partials, merged by the finish kernel (acc's padded lanes: 0, or NaN with NaN scores).
    part = (row * heads + head) * ws_splits + split
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_ok[:, None])
    tl.store(part_m_ptr + part[None, :], m_i, mask=g_ok[None, :])
    tl.store(part_l_ptr + part[None, :], l_i, mask=g_ok[None, :])


@triton.jit
def _finish_kernel(
        seq_lens_ptr, modes_ptr, support_ptr, out_ptr, mass_ptr,
        part_acc_ptr, part_m_ptr, part_l_ptr, stat_m_ptr, stat_l_ptr,
        heads, max_blocks, eta,
        stride_sb, stride_sh, stride_ob, stride_oh, stride_mb, stride_mh, ws_blocks, ws_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, TILE_BLOCKS: tl.constexpr, MIN_SPLITS: tl.constexpr,
        NB_PAD: tl.constexpr, S_CHUNK: tl.constexpr, RETURN_MASS: tl.constexpr, SELECT: tl.constexpr):
    """Step 3 of the module docstring for program (row * heads + head)."""
    row = tl.program_id(0) // heads
    head = tl.program_id(0) % heads
    mode = tl.load(modes_ptr + row)
    seq_len = tl.load(seq_lens_ptr + row)
    n_causal = tl.minimum(tl.cdiv(seq_len, BLOCK), max_blocks)
    listed = _listed_blocks(support_ptr, row, head // GROUP, mode == _SPARSE, n_causal, stride_sb, stride_sh,
                            GROUP, GROUP_PAD, NB_PAD)
    n_listed = tl.sum(listed.to(tl.int32), 0)
    _, n_splits = splits(n_listed, TILE_BLOCKS, SPLIT_BLOCKS, MIN_SPLITS)
    _finish_head(row, head, heads, mode, n_splits, n_causal, max_blocks, eta,
                 out_ptr, mass_ptr, support_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                 stat_m_ptr, stat_l_ptr,
                 stride_ob, stride_oh, stride_mb, stride_mh, stride_sb, stride_sh,
                 ws_blocks, ws_splits, HEAD_DIM, BLOCK_D, S_CHUNK, NB_PAD, RETURN_MASS, SELECT)


def _check_kernel_inputs(q, k_pages, v_pages, page_table, seq_lens, modes, support, k_scale=None,
                         v_scale=None) -> None:
    """What this kernel needs beyond the shared contract (no host sync): head_dim a multiple of
    16 (`triton_head_dim`), one device, unit strides where the kernel indexes densely; fp8
    pages and their scales contiguous (a key's scale is found at its code offset / head_dim)."""
    triton_head_dim.check(q.shape[2])
    tensors = {"q": q, "k_pages": k_pages, "v_pages": v_pages, "page_table": page_table,
               "seq_lens": seq_lens, "modes": modes, "support": support}
    if k_scale is not None:
        tensors.update(k_scale=k_scale, v_scale=v_scale)
        if not all(t.is_contiguous() for t in (k_pages, v_pages, k_scale, v_scale)):
            raise ValueError("fp8 pages: k_pages, v_pages, k_scale and v_scale must be contiguous (a cache "
                             "plane's layout)")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if q.stride(2) != 1 or k_pages.stride(3) != 1:
        raise ValueError("q and k_pages must be contiguous in head_dim")
    if k_pages.stride() != v_pages.stride():
        raise ValueError(f"k_pages and v_pages must have the same strides, got "
                         f"{k_pages.stride()} and {v_pages.stride()}")
    if support.stride(2) != 1 or not seq_lens.is_contiguous() or not modes.is_contiguous() \
            or page_table.stride(1) != 1:
        raise ValueError("seq_lens and modes must be contiguous, support contiguous in blocks, page_table "
                         "contiguous in pages")


def decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes, support, *,
                     block_size: int, eta: float, scale: float | None = None,
                     return_mass: bool = False, workspace: DecodeWorkspace | None = None,
                     validate: bool = True, reuse: bool = False, k_scale=None, v_scale=None):
    """One query token per row against its paged keys, per-row WISE mode (docs/DESIGN.md).

    q: [batch, heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]
    (same strides); page_table: int32[batch, max_pages]; seq_lens, modes: int32[batch];
    support: bool[batch, heads, max_blocks], written in place for discovery rows.
    Returns (out [batch, heads, head_dim] in q's dtype, support) and, with return_mass, mass
    float32[batch, heads, max_blocks] (discovery rows; zeros elsewhere).
    With a `workspace` and validate=False the call allocates nothing and does not sync
    (CUDA-graph capturable); out and mass are then views of the workspace. validate: check the
    values on the host first (`wise_torch.decode_check.check_call`). NaN in q, k or v gives NaN
    outputs; a SPARSE head that selects no causal block (outside the contract) gives NaN
    outputs when not validated. reuse: a reuse loop's call, every row SPARSE or DENSE (checked
    with validate): the finish kernel is compiled without the selection (mass: zeros).
    k_scale, v_scale: an fp8 cache's scales float32 [num_pages, page_size, kv_heads], k_pages and
    v_pages then its uint8 codes, dequantized in registers (module docstring).
    """
    check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size, eta=eta,
               validate=validate, reuse=reuse, k_scale=k_scale, v_scale=v_scale)
    _check_kernel_inputs(q, k_pages, v_pages, page_table, seq_lens, modes, support, k_scale, v_scale)
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    max_blocks = support.shape[2]
    if workspace is None:
        config = config_for(head_dim, q.dtype, "auto" if k_scale is None else "fp8")
        workspace = DecodeWorkspace.allocate(max(batch, 1), heads, kv_heads, head_dim, max_blocks,
                                             dtype=q.dtype, device=q.device, block_size=block_size, config=config)
    else:
        workspace.check_fits(batch, heads, kv_heads, head_dim, max_blocks, block_size, q.dtype, q.device)
    out, mass = workspace.out[:batch], workspace.mass[:batch, :, :max_blocks]
    if batch:
        for kernel, grid, args, kwargs in kernel_launches(
                q, k_pages, v_pages, page_table, seq_lens, modes, support, out, mass, workspace,
                scale=head_dim ** -0.5 if scale is None else scale, eta=eta, return_mass=return_mass,
                reuse=reuse, k_scale=k_scale, v_scale=v_scale):
            kernel[grid](*args, **kwargs)
    return (out, support, mass) if return_mass else (out, support)


def kernel_launches(q, k_pages, v_pages, page_table, seq_lens, modes, support, out, mass, ws, *,
                    scale, eta, return_mass, reuse: bool = False, k_scale=None, v_scale=None):
    """[(kernel, grid, args, kwargs)] of a checked call in launch order: the split kernel, then
    the finish kernel (also used to compile offline). k_scale, v_scale: fp8 pages' scales."""
    fp8 = k_scale is not None
    if fp8 and ws.config.num_stages > FP8_MAX_STAGES:
        raise ValueError(f"fp8 pages run at num_stages <= {FP8_MAX_STAGES} (Triton cannot pipeline one-byte loads "
                         f"deeper on sm90); the workspace's config has {ws.config.num_stages}: use "
                         f"config_for(head_dim, dtype, 'fp8')")
    batch, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    max_blocks = support.shape[2]
    config, block_size = ws.config, ws.block_size
    group = heads // kv_heads
    rule = split_rule(config, block_size)
    max_splits = split_plan.max_splits(max_blocks, **rule)
    support = support.view(torch.uint8)
    partials = (ws.part_acc, ws.part_m, ws.part_l, ws.stat_m, ws.stat_l)
    shared = dict(HEAD_DIM=head_dim, BLOCK_D=triton_head_dim.block_d(head_dim), GROUP=group,
                  GROUP_PAD=triton.next_power_of_2(group), BLOCK=block_size,
                  SPLIT_BLOCKS=rule["split"], MIN_SPLITS=rule["min_splits"], NB_PAD=triton.next_power_of_2(max_blocks))
    split = (
        _split_kernel, (batch * kv_heads, max_splits),
        (q, k_pages, v_pages, k_scale if fp8 else k_pages, v_scale if fp8 else v_pages, page_table, seq_lens,
         modes, support, ws.starts, ws.blocks, *partials,
         kv_heads, max_blocks, scale * math.log2(math.e),
         q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
         page_table.stride(0), support.stride(0), support.stride(1), ws.max_blocks, ws.max_splits),
        dict(shared, BLOCK_G=1 if group == 1 and not config.mha_dots else max(16, triton.next_power_of_2(group)),
             PAGE=k_pages.shape[1], TILE_N=rule["tile"] * block_size,
             DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
             KV_ALIGN=16 if all(stride % 16 == 0 for stride in k_pages.stride()[:3]) else 1, FP8=fp8,
             num_warps=config.num_warps, num_stages=config.num_stages))
    finish = (
        _finish_kernel, (batch * heads,),
        (seq_lens, modes, support, out, mass, *partials, heads, max_blocks, eta,
         support.stride(0), support.stride(1), out.stride(0), out.stride(1), mass.stride(0), mass.stride(1),
         ws.max_blocks, ws.max_splits),
        dict(shared, TILE_BLOCKS=rule["tile"], S_CHUNK=min(16, triton.next_power_of_2(max_splits)),
             RETURN_MASS=return_mass, SELECT=not reuse,
             num_warps=4, num_stages=1))
    return [split, finish]


def all_blocks_support(seq_lens: torch.Tensor, heads: int, max_blocks: int, block_size: int) -> torch.Tensor:
    """The all-causal-blocks support: seq_lens int[batch] -> bool[batch, heads, max_blocks]."""
    causal = torch.arange(max_blocks, device=seq_lens.device) * block_size < seq_lens[:, None]
    return causal[:, None, :].expand(-1, heads, -1).contiguous()
