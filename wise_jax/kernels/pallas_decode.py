"""Paged split-KV decode attention with per-row WISE modes, as Pallas kernels (Triton lowering).

One call serves a batch whose rows may each be DENSE, DISCOVER, DISCOVER_UNION or SPARSE
(`wise_core.modes`). The design is the Triton kernel's (`wise_torch.kernels.triton_decode`):
two launches by default, a split kernel over the grid (batch, heads, max_splits) and a finish
kernel over (batch, heads); nothing else runs on the device (no memset, no other op).

1. List. A row's attended blocks are every causal block (DENSE, DISCOVER, DISCOVER_UNION) or
   the causal blocks of the head's support (SPARSE), numbered by a prefix sum over the bits
   (one pass over the row's blocks per program). Split `s` owns list entries
   [s * split_size, (s + 1) * split_size) and scatters their first-key cache rows (page-table
   entry * page_size + offset) to a compacted list; every step of its loop then reads the next
   `tile_n` keys' rows from that list: no step scans the blocks. A dense row's list is
   0, 1, 2, ...; a sparse row selecting every causal block has the very same list, hence the
   same splits and accumulation order: the two are bitwise equal by construction. Splits past
   a row's list do nothing (a short or sparse row costs few programs); `split_size` depends on
   the row's list length only, by `wise_core.split_plan`: the fewest splits of at most
   `split_keys` keys, as even as whole tiles allow (`min_splits` gives rows listing few blocks
   more, smaller splits).
2. Attend. Online softmax in base 2 over the split's entries, `tile_n` keys per step, either
   as reductions or (`KernelConfig.dots`) as tensor-core dots with q padded to 16 rows, the
   Triton kernel's `mha_dots`. Discovery rows also store, per block, its sum of exponentials
   and the running max it is relative to; the output math is the dense path's, so DISCOVER and
   DISCOVER_UNION outputs are bitwise DENSE. Each split stores (acc, max, sum).
3. Finish, per (row, head): merge the splits by their maxima, write the output, the block mass
   of discovery rows (with return_mass; zeros for other rows) and support': for discovery rows
   `wise_core.reference.select_blocks` by sort + prefix sum (below), OR-ed into the held
   support for DISCOVER_UNION; the held support otherwise. With `KernelConfig.fused_finish` the
   last split of each (row, head) to arrive finishes instead (an atomic counter): one launch,
   but the counter must be zeroed per call (one small XLA op) -- a launch setting to sweep.

Selection. Pallas has no sort primitive on GPU; the finish sorts (mass bits, block index)
pairs by a bitonic network written with reshapes and reductions, which the Triton lowering
takes (the network `tl.sort` builds): mass descending, ties to the lower index,
O(blocks log^2 blocks) compare-exchanges over the row's blocks in registers. Then, as the
Triton kernel's `_select_ranked`: running = prefix sum of the ranked masses, and rank r is
kept iff r == 0 or running[r - 1] < eta * running[-1], i.e. r <= #{running < eta * total}.
Subnormal masses count as 0 (as the reference). The prefix sum's order may differ from the
reference's in the last bits: the two agree except where a running sum lies within float32
rounding of the threshold (the spec allows this). A discovery row keeps causal blocks only.

NaN and empty rows. NaN in q, k or v reaches the output (and the mass) as NaN. A SPARSE head
that selects no causal block (outside the contract: `validate` rejects it) outputs
0 / 0 = NaN, as every implementation does.

Backend. This module is the Pallas Triton lowering (`_compiler_params`), deprecated in jax
0.11 but supported there, and the path CI checks: the tests run the kernels with
`interpret=True`, lower them for CUDA to Triton IR and compile that IR for sm90 with the
Triton compiler. `wise_jax.kernels.mosaic_decode` runs the split kernel on Mosaic GPU with
this module's split rule (listing its blocks itself; interpreted, from `_list_kernel`, a launch
of its own) and its finish;
`wise_jax.kernels.choice` picks between the two. The backend is one choice per call, for every
row: a SPARSE row with every block selected must be bitwise DENSE, which two backends'
arithmetic would not give.

GQA: each program serves one query head (supports are per query head), reading its KV head.

head_dim: a power of two, or any multiple of 16 (huginn-0125's 96). The Triton lowering takes
tensors of power-of-two sizes only, so q, K and V are read over `width` = the next power of
two lanes (gathered by lane index: a block of the full head_dim cannot be loaded whole), the
lanes past head_dim masked (they load 0, so they add nothing to q.k nor p.v); the partial
accumulators are `width` wide and the finish stores the head_dim lanes of the output. A
power-of-two head_dim runs unmasked, as without padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from wise_core import modes as wise_modes
from wise_core import split_plan
from wise_jax.decode_check import check_call

DOT_ROWS = 16  # q padded to this many rows for tensor-core dots (the smallest tl.dot tile)
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape, in keys as the Triton kernel's: keys per loop step (tile_n), keys per
    program (split_keys, bounds its work), min_splits (a row listing few blocks still gets up
    to this many programs: its splits shrink to whole tiles), num_warps and num_stages (Triton),
    dots (q.K and p.V as tensor-core dots, q padded to 16 rows; else reductions), fused_finish
    (the last split to arrive finishes: one launch, a zeroed counter per call).
    tile_n and split_keys are powers of two; a call rounds both up to whole blocks."""

    tile_n: int = 64
    split_keys: int = 512
    min_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    dots: bool = False
    fused_finish: bool = False

    def __post_init__(self) -> None:
        for name in ("tile_n", "split_keys", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 \
                    or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a positive power of two, got {value!r}")
        if self.split_keys < self.tile_n:
            raise ValueError(f"KernelConfig needs tile_n <= split_keys, got {self}")
        for name in ("min_splits", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KernelConfig.{name} must be a positive integer, got {value!r}")

    def tile_blocks(self, block_size: int) -> int:
        return split_plan.split_units(block_size, self.tile_n, self.split_keys)[0]

    def split_blocks(self, block_size: int) -> int:
        return split_plan.split_units(block_size, self.tile_n, self.split_keys)[1]

    def max_splits(self, block_size: int, max_blocks: int) -> int:
        """Most splits of a row of max_blocks blocks (`wise_core.split_plan`): the grid's split axis."""
        return split_plan.max_splits(max_blocks, tile=self.tile_blocks(block_size),
                                     split=self.split_blocks(block_size), min_splits=self.min_splits)


# Fixed launch configurations per (head_dim, dtype), as the Triton kernel's table (a decode step
# is one compiled program; no autotuning). bench_pallas.py --sweep times the alternatives.
CONFIGS: dict[tuple[int, str], KernelConfig] = {
    (128, "bfloat16"): KernelConfig(tile_n=64, split_keys=512, num_stages=3, dots=True),
    (128, "float16"): KernelConfig(tile_n=64, split_keys=512, num_stages=3, dots=True),
    (128, "float32"): KernelConfig(tile_n=32, split_keys=256),
    (64, "bfloat16"): KernelConfig(tile_n=128, split_keys=1024),
    (64, "float16"): KernelConfig(tile_n=128, split_keys=1024),
    (64, "float32"): KernelConfig(tile_n=64, split_keys=512),
}


def config_for(head_dim: int, dtype) -> KernelConfig:
    """The table's configuration for (head_dim, dtype); KernelConfig() for other head dims. A
    head_dim that is not a power of two (huginn-0125's 96) runs its tiles' width's entry (128
    for 96; module docstring, head_dim): not tuned on a GPU."""
    return CONFIGS.get((_next_pow2(head_dim), jnp.dtype(dtype).name), KernelConfig())


def _compiler_params(num_warps: int, num_stages: int):
    """The GPU backend of this module's kernels: the Pallas Triton lowering (module docstring)."""
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _lanes(dims, head_dim: int):
    """The mask of head_dim's lanes among dims int32[width] (width = _next_pow2(head_dim)):
    dims < head_dim, or None when no lane is padded (the unmasked code)."""
    return None if dims.shape[0] == head_dim else dims < head_dim


def _with_lanes(mask, lanes):
    """mask [.., 1] & lanes [width] (`_lanes`; mask itself when lanes is None)."""
    return mask if lanes is None else mask & lanes[None, :]


def _load_lanes(ref):
    """ref [head_dim] -> [width]: its lanes, 0 past head_dim (a whole load when not padded)."""
    head_dim = ref.shape[-1]
    if _next_pow2(head_dim) == head_dim:
        return ref[...]
    dims = jnp.arange(_next_pow2(head_dim), dtype=jnp.int32)
    return pl_triton.load(ref.at[dims], mask=_lanes(dims, head_dim), other=0)


def _store_lanes(ref, b, h, x):
    """x [width] -> ref[b, h] [head_dim]: its lanes up to head_dim (a whole store when not padded)."""
    head_dim = ref.shape[-1]
    if x.shape[-1] == head_dim:
        ref[b, h, :] = x
        return
    dims = jnp.arange(x.shape[-1], dtype=jnp.int32)
    pl_triton.store(ref.at[b, h, dims], x, mask=_lanes(dims, head_dim))


def _dequantize(codes, scales, dtype, interpret: bool):
    """fp8 pages read in registers: codes uint8 [n, width] (e4m3fn bit patterns), scales float32
    [n, 1] -> value(code) * scale in float32, rounded once to `dtype`: `wise_core.kv_quant`'s
    dequantize, bitwise. value(code) is built from the bits with integer ops (the Triton lowering
    has no float8 type to bitcast to): a normal code (exponent e > 0, mantissa m) is the float32
    of sign, exponent e - 7 + 127 and mantissa m << 20, a subnormal one m * 2**-9 (exact), codes
    0x7F and 0xFF NaN.

    interpret: the kernel runs in the Pallas interpreter, compiled by XLA for the CPU, which
    drops a float32 -> bfloat16 -> float32 round trip fused into the reduction that reads it
    (q.k then took the unrounded values: measured, 0.3 % off per score; an optimization barrier
    does not keep it). There the product is rounded to `dtype`'s values in float32 first:
    `lax.reduce_precision` (round to nearest even, as the conversion), which XLA keeps, and for
    float16's subnormals (which XLA's reduce_precision flushes to zero) rint(x / 2**-24) * 2**-24,
    exact in float32; the conversion is then exact. bfloat16 has no such case here: a nonzero
    product is >= 2**-125 (`wise_core.kv_quant`: MIN_SCALE), a normal number. The Triton lowering
    rounds on the conversion (cvt.rn) and keeps it."""
    c = codes.astype(jnp.int32)
    exponent, mantissa, negative = (c >> 3) & 0xF, c & 7, c >= 0x80
    bits = (jnp.where(negative, jnp.int32(-(2 ** 31)), 0) | ((exponent + 120) << 23) | (mantissa << 20))
    normal = jax.lax.bitcast_convert_type(bits, jnp.float32)
    small = mantissa.astype(jnp.float32) * jnp.float32(2.0 ** -9)
    small = jnp.where(negative, -small, small)          # code 0x80: -0.0
    value = jnp.where(exponent == 0, small, normal)
    value = jnp.where((c & 0x7F) == 0x7F, jnp.float32(jnp.nan), value)
    product = value * scales
    if interpret and jnp.dtype(dtype) != jnp.float32:
        info = jnp.finfo(dtype)
        rounded = jax.lax.reduce_precision(product, exponent_bits=info.nexp, mantissa_bits=info.nmant)
        if jnp.dtype(dtype) == jnp.float16:
            step = float(info.smallest_subnormal)                       # 2**-24
            subnormal = jnp.round(product * jnp.float32(1 / step)) * jnp.float32(step)
            rounded = jnp.where(jnp.abs(product) < jnp.float32(info.tiny), subnormal, rounded)
        product = rounded
    return product.astype(dtype)


# ---------------------------------------------------------------------------------------------
# Pieces shared by the split and the finish kernel


def _row_list(support_ref, b, h, seq_len, mode, *, block_size, blocks_pad, tile_blocks,
              split_blocks, min_splits):
    """(listed bool[blocks_pad], n_listed, split_size, n_splits) of row b, head h: the causal
    blocks it attends (SPARSE: its support; else all) and how its list is split."""
    n_blocks = support_ref.shape[-1]
    index = jnp.arange(blocks_pad, dtype=jnp.int32)
    n_causal = jnp.minimum((seq_len + block_size - 1) // block_size, n_blocks)
    held = pl_triton.load(support_ref.at[b, h, index],
                          mask=(index < n_causal) & (mode == wise_modes.SPARSE), other=False)
    listed = (held | (mode != wise_modes.SPARSE)) & (index < n_causal)
    n_listed = jnp.sum(listed.astype(jnp.int32))
    return (listed, n_listed, *_splits(n_listed, tile_blocks=tile_blocks,
                                       split_blocks=split_blocks, min_splits=min_splits))


def _splits(n_listed, *, tile_blocks, split_blocks, min_splits):
    """(split_size, n_splits) of a row listing n_listed blocks (`_split_size`; one split at
    least, even for an empty list)."""
    size = _split_size(n_listed, tile_blocks=tile_blocks, split_blocks=split_blocks,
                       min_splits=min_splits)
    return size, jnp.maximum((n_listed + size - 1) // size, 1)


def _list_order(listed, n_listed, seq_len, *, block_size):
    """(rank, slot, tail_keys) of a row's listed bool[blocks_pad]: each block's position in
    the list (for listed blocks), the scatter slot of each block -- a permutation, listed blocks
    to their rank and the others after them, since the interpreter's masked scatter writes
    every lane and no two lanes may share a slot -- and the valid keys of the last entry (only
    the last causal block can be partial; when listed, it is the last entry)."""
    block = jnp.arange(listed.shape[0], dtype=jnp.int32)
    upto = jnp.cumsum(listed.astype(jnp.int32))  # listed blocks up to and including each
    rank = upto - 1
    slot = jnp.where(listed, rank, n_listed + block - upto)
    n_causal = (seq_len + block_size - 1) // block_size
    tail_listed = jnp.sum(jnp.where(block == n_causal - 1, listed, False).astype(jnp.int32)) > 0
    return rank, slot, jnp.where(tail_listed, seq_len - (n_causal - 1) * block_size, block_size)


def _split_size(n_listed, *, tile_blocks, split_blocks, min_splits):
    """Blocks per split of a row listing n_listed blocks (`wise_core.split_plan.split_size`):
    its list in as few splits of at most split_blocks as it takes (up to min_splits for a short
    row), as even as whole tiles allow (33 blocks at 32 a split: 18 + 15, not 32 + 1)."""
    n_splits = jnp.maximum((n_listed + split_blocks - 1) // split_blocks, min_splits)
    per_split = (n_listed + n_splits - 1) // n_splits
    wanted = (per_split + tile_blocks - 1) // tile_blocks * tile_blocks
    return jnp.minimum(jnp.maximum(wanted, tile_blocks), split_blocks)


def _bitonic_sort(key, index):
    """Sort (key, index) int32[n] pairs (n a power of two): key descending, ties to the lower
    index (indices distinct). A bitonic network of reshapes and size-2 reductions (what
    `tl.sort` builds), so the Triton lowering takes it; O(n log^2 n) compare-exchanges."""
    n = key.shape[0]
    size = 2
    while size <= n:
        stride = size // 2
        while stride >= 1:
            shape = (n // (2 * stride), 2, stride)
            k3, i3 = key.reshape(shape), index.reshape(shape)
            # The partner of an element is the other one on axis 1: the pair's sum minus itself
            # (int32 wraps around, exactly).
            pk = jnp.sum(k3, axis=1, keepdims=True) - k3
            pi = jnp.sum(i3, axis=1, keepdims=True) - i3
            right = jax.lax.broadcasted_iota(jnp.int32, shape, 1) == 1
            # Sub-sequences of `size` elements alternate direction; the last merge (size == n)
            # is descending throughout.
            group = jax.lax.broadcasted_iota(jnp.int32, shape, 0) // (size // (2 * stride))
            descending = group % 2 == 0
            ahead = (k3 > pk) | ((k3 == pk) & (i3 < pi))  # this element ranks before its partner
            stay = (ahead != right) == descending
            key = jnp.where(stay, k3, pk).reshape(n)
            index = jnp.where(stay, i3, pi).reshape(n)
            stride //= 2
        size *= 2
    return key, index


def _select_ranked(mass, eta):
    """mass float32[n] >= 0 (n a power of two) -> (block index, kept), both in rank order.

    Rank: mass descending, ties to the lower index; subnormals count as 0. Kept: rank r with
    r == 0 or running[r - 1] < eta * total, i.e. r <= #{r' : running[r'] < eta * total}
    (running is non-decreasing)."""
    n = mass.shape[0]
    mass = jnp.where(mass < jnp.finfo(jnp.float32).tiny, jnp.float32(0), mass)  # NaN stays
    index = jnp.arange(n, dtype=jnp.int32)
    key, order = _bitonic_sort(jax.lax.bitcast_convert_type(mass, jnp.int32), index)
    running = jnp.cumsum(jax.lax.bitcast_convert_type(key, jnp.float32))
    total = jnp.sum(jnp.where(index == n - 1, running, 0.0))
    below = jnp.sum((running < jnp.float32(eta) * total).astype(jnp.int32))
    return order, index <= below


# ---------------------------------------------------------------------------------------------
# Kernels


def _split_kernel(seq_lens_ref, modes_ref, support_ref, page_table_ref, q_ref, k_ref, v_ref,
                  *refs, block_size, page_size, tile_blocks, split_blocks, min_splits, scale,
                  dots, finish, barrier, fp8, interpret):
    """Steps 1 and 2 of the module docstring for program (row b, head h, split s).

    page_table_ref: [max_pages]; q_ref: [head_dim]; k_ref, v_ref: [num_pages * page_size,
    head_dim] (this head's KV head); other refs whole: support [batch, heads, max_blocks];
    list, stat_m, stat_l [batch, heads, blocks_pad] (by list position: for discovery rows
    the block); acc [batch, heads, splits_pad, width]; m, l [batch, heads, splits_pad] (width:
    head_dim padded to a power of two, module docstring).
    With `finish` (a dict of _finish's static arguments, or None), refs also hold a zeroed
    counter int32[batch, heads] (input, aliased to the last output) and the finish outputs:
    the last split of each (row, head) to arrive runs _finish. barrier: synchronise the
    program's threads between writing and reading the list, and before the counter (off in
    the interpreter, which runs a program's code as one thread). fp8: k_ref, v_ref hold uint8
    e4m3fn codes and refs start with k_scale, v_scale [num_pages * page_size] (this KV head's
    scales); each tile's K/V are dequantized to q's dtype in registers (`_dequantize`), so the
    rest is the arithmetic of a call on the dequantized pages. interpret: the kernel runs in the
    Pallas interpreter (`_dequantize`).
    """
    if fp8:
        k_scale_ref, v_scale_ref, *refs = refs
    if finish is None:
        list_ref, stat_m_ref, stat_l_ref, acc_ref, m_ref, l_ref = refs
    else:
        (_, list_ref, stat_m_ref, stat_l_ref, acc_ref, m_ref, l_ref, *finish_refs,
         counter_ref) = refs
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len, mode = seq_lens_ref[b], modes_ref[b]
    blocks_pad = list_ref.shape[-1]
    listed, n_listed, size, n_splits = _row_list(
        support_ref, b, h, seq_len, mode, block_size=block_size, blocks_pad=blocks_pad,
        tile_blocks=tile_blocks, split_blocks=split_blocks, min_splits=min_splits)
    discovering = (mode == wise_modes.DISCOVER) | (mode == wise_modes.DISCOVER_UNION)

    @pl.when(s < n_splits)
    def _attend():
        # 1. This split's entries [lo, hi) of the row's list: first-key cache rows.
        block = jnp.arange(blocks_pad, dtype=jnp.int32)
        rank, slot, tail_keys = _list_order(listed, n_listed, seq_len, block_size=block_size)
        lo = s * size  # a multiple of tile_blocks
        hi = jnp.minimum(lo + size, n_listed)
        mine = listed & (rank >= lo) & (rank < hi)
        first = block * block_size
        page = pl_triton.load(page_table_ref.at[jnp.where(mine, first // page_size, 0)],
                              mask=mine, other=0)
        pl_triton.store(list_ref.at[b, h, slot], page * page_size + first % page_size, mask=mine)
        if barrier:  # a program reads back only the entries it wrote
            pl_triton.debug_barrier()

        # 2. Online softmax over the entries, tile_n keys per step, in base 2.
        head_dim = q_ref.shape[-1]
        width = _next_pow2(head_dim)  # head_dim's lanes (module docstring: head_dim)
        tile_n = tile_blocks * block_size
        rows_g = DOT_ROWS if dots else 1
        g = jax.lax.broadcasted_iota(jnp.int32, (rows_g, width), 0)
        q = jnp.where(g == 0, _load_lanes(q_ref)[None, :], 0).astype(q_ref.dtype)  # [rows_g, width]
        offs = jnp.arange(tile_n, dtype=jnp.int32)
        within = offs % block_size
        dims = jnp.arange(width, dtype=jnp.int32)
        lanes = _lanes(dims, head_dim)
        column = jax.lax.broadcasted_iota(jnp.int32, (tile_n, rows_g), 1)
        head0 = jax.lax.broadcasted_iota(jnp.int32, (1, rows_g), 1) == 0  # the real head

        def step(i, carry):
            m, l, acc = carry  # [1, rows_g], [1, rows_g], [rows_g, width]
            t = lo + i * tile_blocks
            entry = t + offs // block_size
            in_list = entry < hi
            start = pl_triton.load(list_ref.at[b, h, jnp.where(in_list, entry, lo)],
                                   mask=in_list, other=0)
            key_ok = in_list & ((entry < n_listed - 1) | (within < tail_keys))
            rows = (start + within)[:, None]
            k = pl_triton.load(k_ref.at[rows, dims[None, :]], mask=_with_lanes(key_ok[:, None], lanes), other=0)
            v = pl_triton.load(v_ref.at[rows, dims[None, :]], mask=_with_lanes(key_ok[:, None], lanes), other=0)
            if fp8:  # codes -> q's dtype; masked keys and lanes read code 0 (+0.0) and scale 0
                k_scales = pl_triton.load(k_scale_ref.at[rows], mask=key_ok[:, None], other=0.0)
                v_scales = pl_triton.load(v_scale_ref.at[rows], mask=key_ok[:, None], other=0.0)
                k = _dequantize(k, k_scales, q_ref.dtype, interpret)
                v = _dequantize(v, v_scales, q_ref.dtype, interpret)
            if dots:
                scores = jax.lax.dot_general(k, q, (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32)
            else:
                scores = jnp.sum(k.astype(jnp.float32) * q.astype(jnp.float32), axis=1,
                                 keepdims=True)
            scores = jnp.where(key_ok[:, None], scores * scale, -jnp.inf)  # [tile_n, rows_g]
            m_new = jnp.maximum(m, jnp.max(scores, axis=0, keepdims=True))
            m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - m_base)
            p = jnp.exp2(scores - m_base)
            if dots:
                pv = jax.lax.dot_general(p.astype(v.dtype), v, (((0,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)
            else:
                pv = jnp.sum(p * v.astype(jnp.float32), axis=0, keepdims=True)
            acc = acc * alpha.reshape(rows_g, 1) + pv
            l = l * alpha + jnp.sum(p, axis=0, keepdims=True)

            @pl.when(discovering)  # per block: sum of exp2(s - m_base), relative to m_base
            def _block_stats():
                p0 = jnp.sum(jnp.where(column == 0, p, 0.0), axis=1)
                sums = jnp.sum(p0.reshape(tile_blocks, block_size), axis=1)
                pos = t + jnp.arange(tile_blocks, dtype=jnp.int32)  # < blocks_pad: t is tile-aligned
                ok = pos < hi
                m0 = jnp.sum(jnp.where(head0, m_base, 0.0))
                pl_triton.store(stat_m_ref.at[b, h, pos], jnp.full((tile_blocks,), m0), mask=ok)
                pl_triton.store(stat_l_ref.at[b, h, pos], sums, mask=ok)

            return m_new, l, acc

        init = (jnp.full((1, rows_g), -jnp.inf, jnp.float32), jnp.zeros((1, rows_g), jnp.float32),
                jnp.zeros((rows_g, width), jnp.float32))
        n_steps = (hi - lo + tile_blocks - 1) // tile_blocks
        m, l, acc = jax.lax.fori_loop(0, n_steps, step, init)
        acc_ref[b, h, s, :] = jnp.sum(jnp.where(g == 0, acc, 0.0), axis=0)  # row 0: the head
        m_ref[b, h, s] = jnp.sum(jnp.where(head0, m, 0.0))
        l_ref[b, h, s] = jnp.sum(jnp.where(head0, l, 0.0))
        if finish is None:
            return
        if barrier:  # every thread's partial stores precede the counter's release
            pl_triton.debug_barrier()
        arrived = pl_triton.atomic_add(counter_ref, (b, h), jnp.ones((), jnp.int32))  # acq_rel

        @pl.when(arrived == n_splits - 1)
        def _last_split_finishes():
            _finish(b, h, n_splits, seq_lens_ref, modes_ref, support_ref, stat_m_ref, stat_l_ref,
                    acc_ref, m_ref, l_ref, *finish_refs, block_size=block_size, volatile=True,
                    **finish)


def _list_kernel(seq_lens_ref, modes_ref, support_ref, page_table_ref, rows_ref, meta_ref, *,
                 block_size, page_size):
    """Program (row b, head h): its whole list as cache blocks, for `mosaic_decode`'s split
    kernel when interpreted or with `MosaicConfig.list_launch` (step 1 of the module docstring
    as its own launch).

    page_table_ref: [max_pages]; whole refs: support [batch, heads, max_blocks]; rows
    int32[batch, heads, row_len >= blocks_pad]: entry p < n_listed is the p-th listed block's
    cache block (page * page_size // block_size + block within the page), later entries are
    unspecified (never read as addresses); meta int32[batch, heads, 2]: (n_listed, valid keys
    of the last entry)."""
    b, h = pl.program_id(0), pl.program_id(1)
    seq_len, mode = seq_lens_ref[b], modes_ref[b]
    blocks_pad = _next_pow2(support_ref.shape[-1])
    listed, n_listed, _, _ = _row_list(support_ref, b, h, seq_len, mode, block_size=block_size,
                                       blocks_pad=blocks_pad, tile_blocks=1, split_blocks=1,
                                       min_splits=1)
    block = jnp.arange(blocks_pad, dtype=jnp.int32)
    _, slot, tail_keys = _list_order(listed, n_listed, seq_len, block_size=block_size)
    per_page = page_size // block_size
    page = pl_triton.load(page_table_ref.at[jnp.where(listed, block // per_page, 0)], mask=listed,
                          other=0)
    pl_triton.store(rows_ref.at[b, h, slot], page * per_page + block % per_page, mask=listed)
    meta_ref[b, h, 0] = n_listed
    meta_ref[b, h, 1] = tail_keys


def _finish_kernel(seq_lens_ref, modes_ref, support_ref, *refs, block_size, tile_blocks,
                   split_blocks, min_splits, counted, written, **finish):
    """One (row, head) of _finish as its own launch (refs as _finish's, before them with
    `counted` the split kernel's counts int32[batch, heads]: each row's list length, so the
    row's bits need not be counted again; with `written` the split kernel's out, aliased to
    this launch's out)."""
    b, h = pl.program_id(0), pl.program_id(1)
    rule = dict(tile_blocks=tile_blocks, split_blocks=split_blocks, min_splits=min_splits)
    if written:
        _, *refs = refs  # the input side of the aliased out
    if counted:
        counts_ref, *refs = refs
        _, n_splits = _splits(counts_ref[b, h], **rule)
    else:
        _, _, _, n_splits = _row_list(support_ref, b, h, seq_lens_ref[b], modes_ref[b],
                                      block_size=block_size, blocks_pad=refs[0].shape[-1], **rule)
    _finish(b, h, n_splits, seq_lens_ref, modes_ref, support_ref, *refs, block_size=block_size,
            volatile=False, written=written, **finish)


def _finish(b, h, n_splits, seq_lens_ref, modes_ref, support_ref, stat_m_ref, stat_l_ref, acc_ref,
            m_ref, l_ref, out_ref, support_out_ref, *mass_ref, block_size, eta, all_blocks,
            volatile, written=False):
    """Row b, head h: merge its n_splits splits; mass and selection of discovery rows.

    Whole refs: support, support_out, mass (present with return_mass) [batch, heads,
    max_blocks]; stat_m, stat_l [batch, heads, blocks_pad]; acc [batch, heads, splits_pad,
    width >= head_dim, a power of two: lanes past head_dim not stored]; m, l [batch, heads,
    splits_pad]; out [batch, heads, head_dim]. volatile: read
    the partials past the L1 cache (other programs of this launch wrote them). written: the
    split kernel wrote the output of rows of one split (out holds it; their acc is not stored)."""
    index = jnp.arange(stat_m_ref.shape[-1], dtype=jnp.int32)
    n_blocks = support_ref.shape[-1]
    in_row = index < n_blocks
    held = pl_triton.load(support_ref.at[b, h, index], mask=in_row, other=False)  # with the mode
    mode = modes_ref[b]
    discovering = (mode == wise_modes.DISCOVER) | (mode == wise_modes.DISCOVER_UNION)
    n_causal = jnp.minimum((seq_lens_ref[b] + block_size - 1) // block_size, n_blocks)
    merging = (n_splits > 1) if written else True  # this program writes the output
    split = jnp.arange(m_ref.shape[-1], dtype=jnp.int32)
    ran = (split < n_splits) & (merging | discovering)
    # The partials are loaded whole and masked after (unwritten entries are discarded by the
    # select): the loads wait on the program id only, not on the count, mode and seq_len loads.
    def load(ref):
        return pl_triton.load(ref, volatile=volatile)

    m = jnp.where(ran, load(m_ref.at[b, h, split]), -jnp.inf)
    l = jnp.where(ran, load(l_ref.at[b, h, split]), 0.0)
    acc = jnp.where(ran[:, None] & merging, load(acc_ref.at[b, h, :, :]), 0.0)
    m_max = jnp.max(m)
    m_top = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    weight = jnp.exp2(m - m_top)  # 0 for splits without keys
    total = jnp.sum(weight * l)

    def _output():
        _store_lanes(out_ref, b, h, (jnp.sum(weight[:, None] * acc, axis=0) / total).astype(out_ref.dtype))

    if written:
        pl.when(merging)(_output)
    else:
        _output()

    has_stat = discovering & (index < n_causal)
    stat_m = jnp.where(has_stat, load(stat_m_ref.at[b, h, index]), 0.0)
    stat_l = jnp.where(has_stat, load(stat_l_ref.at[b, h, index]), 0.0)
    mass = jnp.where(has_stat, stat_l * jnp.exp2(stat_m - m_top) / total, 0.0)
    if mass_ref:
        pl_triton.store(mass_ref[0].at[b, h, index], mass, mask=in_row)

    @pl.when(jnp.logical_not(discovering))
    def _keep_support():
        pl_triton.store(support_out_ref.at[b, h, index], held, mask=in_row)

    @pl.when(discovering)
    def _select():
        if all_blocks:
            order, keep = index, index < n_causal
        else:
            order, kept = _select_ranked(mass, eta)
            keep = kept & (order < n_causal)  # NaN mass too: causal blocks only
        dst = order < n_blocks
        union = pl_triton.load(support_ref.at[b, h, order],
                              mask=dst & (mode == wise_modes.DISCOVER_UNION), other=False)
        pl_triton.store(support_out_ref.at[b, h, order], keep | union, mask=dst)


# ---------------------------------------------------------------------------------------------
# Launchers


def _finish_shapes(batch, heads, head_dim, n_blocks, out_dtype, return_mass):
    shapes = [jax.ShapeDtypeStruct((batch, heads, head_dim), out_dtype),
              jax.ShapeDtypeStruct((batch, heads, n_blocks), jnp.bool_)]
    if return_mass:
        shapes.append(jax.ShapeDtypeStruct((batch, heads, n_blocks), jnp.float32))
    return shapes


def _lists(block_size, config: KernelConfig):
    return dict(block_size=block_size, tile_blocks=config.tile_blocks(block_size),
                split_blocks=config.split_blocks(block_size), min_splits=config.min_splits)


def _split_call(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size, scale,
                config: KernelConfig, finish, return_mass, interpret: bool, k_scale=None, v_scale=None):
    """The split kernel; with `finish` (dict of eta, all_blocks) it also finishes (fused); with
    k_scale, v_scale (float32 [num_pages, page_size, kv_heads]) k_pages and v_pages are fp8 codes."""
    batch, heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    n_blocks = support.shape[-1]
    group = heads // kv_heads
    blocks_pad = max(_next_pow2(n_blocks), config.tile_blocks(block_size))
    max_splits = config.max_splits(block_size, n_blocks)
    splits_pad = _next_pow2(max_splits)
    k_rows = k_pages.reshape(num_pages * page_size, kv_heads, head_dim)
    v_rows = v_pages.reshape(num_pages * page_size, kv_heads, head_dim)
    whole = pl.BlockSpec()
    kv_spec = pl.BlockSpec((num_pages * page_size, None, head_dim),
                           lambda b, h, s: (0, h // group, 0))
    in_specs = [whole, whole, whole,  # seq_lens, modes, support
                pl.BlockSpec((None, page_table.shape[1]), lambda b, h, s: (b, 0)),
                pl.BlockSpec((None, None, head_dim), lambda b, h, s: (b, h, 0)),  # q
                kv_spec, kv_spec]
    args = [seq_lens, modes, support, page_table, q, k_rows, v_rows]
    fp8 = k_scale is not None
    if fp8:
        scale_spec = pl.BlockSpec((num_pages * page_size, None), lambda b, h, s: (0, h // group))
        in_specs += [scale_spec, scale_spec]
        args += [k_scale.reshape(num_pages * page_size, kv_heads), v_scale.reshape(num_pages * page_size, kv_heads)]
    f32 = jnp.float32
    out_shape = [jax.ShapeDtypeStruct((batch, heads, blocks_pad), jnp.int32),  # list
                 jax.ShapeDtypeStruct((batch, heads, blocks_pad), f32),  # stat_m
                 jax.ShapeDtypeStruct((batch, heads, blocks_pad), f32),  # stat_l
                 jax.ShapeDtypeStruct((batch, heads, splits_pad, _next_pow2(head_dim)), f32),  # acc
                 jax.ShapeDtypeStruct((batch, heads, splits_pad), f32),  # m
                 jax.ShapeDtypeStruct((batch, heads, splits_pad), f32)]  # l
    aliases = {}
    if finish is not None:
        out_shape += _finish_shapes(batch, heads, head_dim, n_blocks, q.dtype, return_mass)
        out_shape.append(jax.ShapeDtypeStruct((batch, heads), jnp.int32))  # counter
        in_specs.append(whole)
        args.append(jnp.zeros((batch, heads), jnp.int32))
        aliases = {len(args) - 1: len(out_shape) - 1}
    lists = _lists(block_size, config)
    del lists["block_size"]
    kernel = functools.partial(
        _split_kernel, block_size=block_size, page_size=page_size, scale=scale * LOG2E,
        dots=config.dots, finish=finish, barrier=not interpret, fp8=fp8, interpret=interpret, **lists)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, max_splits),
        in_specs=in_specs,
        out_specs=[whole] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="wise_decode_split",
    )(*args)


def _list_call(page_table, seq_lens, modes, support, *, block_size, page_size, row_len,
               interpret: bool):
    """(rows, meta) of `_list_kernel`, one launch over (batch, heads)."""
    batch, heads, n_blocks = support.shape
    if row_len < _next_pow2(n_blocks):
        raise ValueError(f"row_len {row_len} < blocks_pad {_next_pow2(n_blocks)}")
    whole = pl.BlockSpec()
    kernel = functools.partial(_list_kernel, block_size=block_size, page_size=page_size)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads),
        in_specs=[whole, whole, whole, pl.BlockSpec((None, page_table.shape[1]), lambda b, h: (b, 0))],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((batch, heads, row_len), jnp.int32),
                   jax.ShapeDtypeStruct((batch, heads, 2), jnp.int32)],
        compiler_params=_compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="wise_decode_list",
    )(seq_lens, modes, support, page_table)


def _finish_call(seq_lens, modes, support, partials, *, head_dim, out_dtype, block_size, config, eta,
                 all_blocks, return_mass, interpret: bool, counts=None, out=None):
    """The finish launch over (batch, heads); the output [batch, heads, head_dim] (the partials'
    acc may be wider: padded lanes); counts: the rows' list lengths int32[batch, heads] (else
    counted from support); out: the outputs the split kernel wrote for rows of one split
    (`_finish`'s written; aliased to this launch's out)."""
    batch, heads = partials[3].shape[:2]
    kernel = functools.partial(_finish_kernel, eta=eta, all_blocks=all_blocks,
                               counted=counts is not None, written=out is not None,
                               **_lists(block_size, config))
    out_shape = _finish_shapes(batch, heads, head_dim, support.shape[-1], out_dtype, return_mass)
    args = ([seq_lens, modes, support] + ([] if out is None else [out])
            + ([] if counts is None else [counts]) + list(partials[1:]))
    return pl.pallas_call(
        kernel,
        grid=(batch, heads),
        in_specs=[pl.BlockSpec()] * len(args),
        out_specs=[pl.BlockSpec()] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases={} if out is None else {3: 0},
        compiler_params=_compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="wise_decode_finish",
    )(*args)


@functools.partial(jax.jit, static_argnames=("block_size", "eta", "scale", "all_blocks",
                                             "return_mass", "config", "interpret"))
def _decode(q, k_pages, v_pages, page_table, seq_lens, modes, support, k_scale, v_scale, *, block_size, eta,
            scale, all_blocks, return_mass, config, interpret):
    finish = dict(eta=eta, all_blocks=all_blocks)
    outputs = _split_call(q, k_pages, v_pages, page_table, seq_lens, modes, support,
                          block_size=block_size, scale=scale, config=config,
                          finish=finish if config.fused_finish else None,
                          return_mass=return_mass, interpret=interpret, k_scale=k_scale, v_scale=v_scale)
    if config.fused_finish:
        return tuple(outputs[6:-1])
    return tuple(_finish_call(seq_lens, modes, support, outputs, head_dim=q.shape[-1], out_dtype=q.dtype,
                              block_size=block_size, config=config, return_mass=return_mass,
                              interpret=interpret, **finish))


# ---------------------------------------------------------------------------------------------
# Public API


def decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size,
                     eta, scale=None, return_mass=False, interpret=None, all_blocks=False,
                     config: KernelConfig | None = None, validate: bool = True, reuse: bool = False,
                     k_scale=None, v_scale=None):
    """Decode attention over a paged KV cache with per-row WISE modes (docs/DESIGN.md).

    q: [batch, heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim];
    page_table: int32[batch, max_pages]; seq_lens: int32[batch] (keys in the cache, >= 1);
    modes: int32[batch] (`wise_core.modes`); support: bool[batch, heads, max_blocks] with
    max_blocks = max_pages * page_size // block_size.
    Returns (out [batch, heads, head_dim] in q's dtype, support' bool[batch, heads, max_blocks])
    and, with return_mass, mass float32[batch, heads, max_blocks] (zeros for rows that do not
    discover). all_blocks: discovery rows select every causal block. interpret: run the
    kernels in the Pallas interpreter (default: when the default backend is not a GPU).
    config: launch parameters (default: `config_for(head_dim, q.dtype)`). validate: also
    check the values (`wise_jax.decode_check.check_call`; under jit a host callback per call).
    reuse: a call of WISE's reuse loops, no row discovers (`wise_jax.attention.decode_attention`;
    checked with validate): the same launch, support' the support held as for any such row.
    NaN in q, k or v gives NaN outputs; a SPARSE head that selects no causal block (outside
    the contract) gives NaN outputs when not validated. k_scale, v_scale: an fp8 cache's scales
    float32 [num_pages, page_size, kv_heads], k_pages and v_pages then its uint8 e4m3fn codes:
    each tile is dequantized to q's dtype in registers by `wise_core.kv_quant`'s arithmetic, so
    the call is bitwise the one on the dequantized pages (`wise_jax.kv_quant.dequantize`); config
    default: `config_for(head_dim, q.dtype)`, as for those pages.
    """
    seq_lens = check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support,
                          block_size=block_size, eta=eta, validate=validate, reuse=reuse,
                          k_scale=k_scale, v_scale=v_scale)
    head_dim = q.shape[-1]
    if config is None:
        config = config_for(head_dim, q.dtype)
    _check_kernel_inputs(head_dim, config)
    if scale is None:
        scale = head_dim ** -0.5
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    outputs = _decode(
        q, k_pages, v_pages, page_table, seq_lens, modes, support, k_scale, v_scale, block_size=block_size,
        eta=float(eta), scale=float(scale), all_blocks=bool(all_blocks),
        return_mass=bool(return_mass), config=config, interpret=bool(interpret))
    return tuple(outputs)


def takes(head_dim: int) -> bool:
    """Whether this kernel takes q/K/V of this head_dim: a power of two, or a multiple of 16
    (padded lanes, module docstring)."""
    return head_dim >= 1 and (head_dim & (head_dim - 1) == 0 or head_dim % 16 == 0)


def _check_kernel_inputs(head_dim: int, config: KernelConfig):
    """What this kernel needs beyond the shared contract: `takes(head_dim)` (>= 16 for dots)."""
    if not takes(head_dim):
        raise ValueError(f"head_dim must be a power of two or a multiple of 16 for the Pallas kernel, "
                         f"got {head_dim}")
    if config.dots and head_dim < 16:
        raise ValueError(f"KernelConfig.dots needs head_dim >= 16, got {head_dim}")
