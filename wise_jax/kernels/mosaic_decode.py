"""Paged split-KV decode attention with per-row WISE modes, the split kernel on Mosaic GPU.

The contract and the split plan (`wise_core.split_plan`) are `wise_jax.kernels.pallas_decode`'s;
this module runs the split kernel, which reads the keys and values, as a Mosaic GPU kernel
(`plgpu`, Hopper: TMA copies into a multi-stage shared-memory ring, mbarriers), for 16-bit
q/K/V with head_dim a multiple of 64. A call is two launches, or one for a reuse call on a GPU (3.):

1. Split kernel, grid (max_splits, batch, heads / rows), split-major (programs start in grid
   order, the last axis fastest: every row's first split before any second, so a sparse call's
   programs for splits its rows lack come last); one warpgroup a program attends split s of
   `MosaicConfig.rows` consecutive heads (1 by default; with more, a and b run for each, their
   tiles one after another through the one ring).
   a. List (`_list_in_kernel`, raw Mosaic GPU code): thread t counts the blocks of its share of
      the row that the row lists (every causal block, or the causal blocks of a SPARSE head's
      support), a scan over the warp (shuffles) and the warps' totals (SMEM) number them, and
      split s keeps its entries (pallas_decode's split size, so a SPARSE row selecting every
      block has DENSE's splits) as cache block indices in SMEM. Split 0 stores the row's count.
   b. Attend: `tile_n` keys a step through `num_stages` slots (a TMA copy of [32, head_dim] per
      block for K and for V, the cache viewed as [cache blocks, 32, kv_heads, head_dim]); the
      tile's q.K and p.V by `MosaicConfig.products` (layout-hinted f32 reductions, or mma.sync
      a warp: `wise_jax.kernels.mosaic_ptx`); an online softmax in base 2. Discovery rows store
      per block (running max, sum of exponentials); outputs are computed as for DENSE, so
      DISCOVER is bitwise DENSE. A block is copied whole, so in the tile of a row's last block
      the values past the row's keys (a page's stale slots, NaN too) are zeroed in the slot
      before p.V (`_zero_values_past_keys`). A split stores its (max, sum) and its acc or, for
      a row's only split, the output itself (the choice depends on the list length only).
2. Finish: `pallas_decode`'s finish kernel (merge by maxima, mass, selection, support'), reading
   this kernel's partials and counts; rows of one split keep the split kernel's output (`out`
   is one buffer of the two launches: an input-output alias).
3. Reuse calls (`reuse=True`: rows SPARSE or DENSE, no mass, no selection): on a GPU no finish
   launch. Each split of a row of several counts itself in (`mosaic_ptx.arrive`, a per-row
   semaphore in GMEM) and the last to arrive merges the row's partials (`_merge`: within f32
   rounding of the finish's merge, not bitwise). support' is the support held, the mass zeros.

Interpreted (jax's GPU interpreter on a CPU), the list is `pallas_decode._list_kernel`, a
launch of its own (`MosaicConfig(list_launch=True)` takes that route on a GPU too), the
products are the reductions and the finish merges: the interpreter runs no raw Mosaic GPU code
and has no semaphores. The mma products and the in-kernel merge are covered by gpu tests only.

Routes tried and their H200 numbers, what bounds the kernel, what ran fastest and the
measurements behind `launch_config`: docs/kernels/mosaic_decode.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref

from wise_core import modes as wise_modes
from wise_jax.decode_check import check_call
from wise_jax.kernels import pallas_decode
from wise_jax.kernels.mosaic_ptx import (COL, ROW, SCALAR, TILED, WARPGROUP, arrive, load_vt, pv_mma,
                                         scalar, scores_mma, shfl_up)

LOG2E = math.log2(math.e)
LIST_CHUNK = 32  # list entries copied to shared memory at least (a TMA moves 128-byte multiples)
LIST_ALIGN = 4  # int32 entries in 16 bytes: a TMA copy's global address must be 16-byte aligned
PRODUCTS = ("mma", "reduce")  # MosaicConfig.products


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch shape: keys per step (tile_n, a multiple of 64: the WGMMA layout's rows), keys
    per program (split_keys) and min_splits (as pallas_decode.KernelConfig), num_stages (tiles
    in flight per program), products (how a tile's q.K and p.V run: "reduce", layout-hinted
    reductions in f32; "mma", tensor-core mma.sync a warp in raw Mosaic GPU code, `scores_mma` /
    `pv_mma`, the reductions when interpreted: the interpreter does not run raw Mosaic GPU code;
    `launch_config` picks "mma" for reuse calls; wgmma, q in row 0 of a 64-row tile, is not
    offered: slower on an H200, docs/kernels/mosaic_decode.md).
    list_launch: the block list as a launch of its own (`pallas_decode._list_kernel`), always so
    when interpreted; else each program lists its split's blocks itself (`_list_in_kernel`).
    rows: heads a program attends (1, 2 or 4: consecutive heads of one sequence, split s of
    each, their tiles through one ring), for calls of many short rows."""

    tile_n: int = 64
    split_keys: int = 1024
    min_splits: int = 1
    num_stages: int = 2
    products: str = "reduce"
    list_launch: bool = False
    rows: int = 1

    def __post_init__(self) -> None:
        for name in ("tile_n", "split_keys"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 \
                    or value & (value - 1):
                raise ValueError(f"MosaicConfig.{name} must be a positive power of two, got {value!r}")
        if self.tile_n < 64 or self.split_keys < self.tile_n:
            raise ValueError(f"MosaicConfig needs 64 <= tile_n <= split_keys, got {self}")
        for name in ("min_splits", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MosaicConfig.{name} must be a positive integer, got {value!r}")
        if isinstance(self.rows, bool) or self.rows not in (1, 2, 4):
            raise ValueError(f"MosaicConfig.rows must be 1, 2 or 4, got {self.rows!r}")
        if self.products not in PRODUCTS:
            raise ValueError(f"MosaicConfig.products must be one of {PRODUCTS}, got {self.products!r}")
        if not isinstance(self.list_launch, bool):
            raise ValueError(f"MosaicConfig.list_launch must be a bool, got {self.list_launch!r}")

    @property
    def dots(self) -> bool:
        """Whether the probabilities enter 16-bit tensor-core dots (rounded to q's dtype)."""
        return self.products != "reduce"

    def split_rule(self) -> pallas_decode.KernelConfig:
        """The pallas_decode launch whose list splits (and finish) this one shares."""
        return pallas_decode.KernelConfig(tile_n=self.tile_n, split_keys=self.split_keys,
                                          min_splits=self.min_splits)


PROGRAMS_PER_SM = 2  # split-kernel programs an H200 SM holds (head_dim 128: registers, see the doc);
# launch_config takes it for every head_dim (a wrong count costs speed, not results)
SPARSE_SPLIT_KEYS = 2048  # keys a split in a reuse call's launch whose rows need several


def launch_config(batch: int, heads: int, max_blocks: int, *, block_size: int,
                  reuse: bool, n_sm: int | None) -> MosaicConfig:
    """The launch of a call given no config: MosaicConfig(), changed for a reuse call (WISE's
    reuse loops: rows SPARSE, a few DENSE) when n_sm is known (not interpreted):
    - products "mma": tensor cores for the tile's products, which shorten the chain of each
      split, faster in sparse on an H200 but 1-2.5 % slower in dense, so plain calls keep the
      reductions.
    - rows past one split (context over split_keys): SPARSE_SPLIT_KEYS keys a split. The grid
      has a program for every split a row could need (a DENSE row's), and every program lists
      its row before it knows whether its split exists, so a sparse call's many empty programs
      cost time; a DENSE row in such a call runs fewer, longer splits (4096-key splits, a little
      faster still in sparse, would give a DENSE row up to 64 tiles in one program).
    - rows of one split: heads grouped (`rows`) where the programs' waves favour it: counting
      a program's time as its rows', waves of the batch * heads / rows programs over the GPU's
      n_sm * PROGRAMS_PER_SM slots times rows is least (ties to more rows). Outputs do not
      depend on rows (bitwise).

    The measurements behind each rule: docs/kernels/mosaic_decode.md."""
    config = MosaicConfig()
    if not reuse or n_sm is None:
        return config
    config = dataclasses.replace(config, products="mma")
    if config.split_rule().max_splits(block_size, max_blocks) != 1:
        return dataclasses.replace(config, split_keys=max(SPARSE_SPLIT_KEYS, config.split_keys))
    slots = PROGRAMS_PER_SM * n_sm

    def time_in_rows(rows):
        return -(-batch * heads // (rows * slots)) * rows

    rows = min((r for r in (4, 2, 1) if heads % r == 0), key=time_in_rows)
    return dataclasses.replace(config, rows=rows)


def sm_count(interpret: bool) -> int | None:
    """The default device's SMs (None when interpreted or not reported)."""
    return None if interpret else getattr(jax.devices()[0], "core_count", None)


def supports(head_dim: int, dtype) -> bool:
    """Whether this kernel takes q/K/V of this head_dim and dtype (16-bit; head_dim 64, 128, 256...: a
    multiple of 64 for its tiles and a power of two for the Pallas finish it shares)."""
    return (head_dim % 64 == 0 and head_dim & (head_dim - 1) == 0
            and jnp.dtype(dtype).name in ("bfloat16", "float16"))


# ---------------------------------------------------------------------------------------------
# 2. The split kernel (Mosaic GPU)


def _layout(x, layout, interpret):
    """Pin a register layout (skipped when interpreted: the interpreter has no rule for it)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _split_kernel(modes_ref, seq_lens_ref, list_in_ref, page_table_ref, q_ref, k_ref, v_ref,
                  stat_m_ref, stat_l_ref, acc_ref, m_ref, l_ref, counts_ref, out_ref,
                  list_smem, meta_smem, totals_smem, q_smem, k_smem, v_smem, acc_smem, out_smem,
                  q_bar, list_bar, k_bar, v_bar, *extra, block_size, page_size, tile_blocks,
                  split_blocks, min_splits, num_stages, group, scale, products, list_launch,
                  reuse, merge, interpret):
    """Program (sequence b, heads [p * rows, (p + 1) * rows), split s): step 1 of the module
    docstring for split s of each of its rows, their tiles one after another through one ring.

    GMEM: modes, seq_lens int32[batch]; list_in: support bool[batch, heads, max_blocks] (the
    list made here, `_list_in_kernel`) or, with list_launch, `pallas_decode._list_kernel`'s rows
    (and its meta in page_table_ref's place); page_table int32[batch, max_pages]; q [batch,
    heads, head_dim]; k, v [num_pages * page_size // block_size, block_size, kv_heads,
    head_dim]; outputs as pallas_decode's partials: stat_m, stat_l [batch, heads, blocks_pad],
    acc [batch, heads, splits_pad, head_dim], m, l [batch, heads, splits_pad]; counts
    int32[batch, heads] (n_listed, for the finish); out [batch, heads, head_dim] (rows of one
    split: the finish leaves them). SMEM: list_smem int32[rows, ...] (each row's split entries),
    meta_smem int32[rows, 2] (n_listed, tail keys), totals_smem int32[4] (per warp counts), q_smem
    [rows, head_dim], k_smem, v_smem [num_stages, tile_n, head_dim] (tiled, swizzled), acc_smem
    [head_dim] f32, out_smem [head_dim]; extra: with merge, the barrier of the merge's copies.
    reuse: a reuse loop's call (rows SPARSE or DENSE): a discovery row's output is NaN (outside
    the contract). merge: the last split of a row to arrive merges the row's splits (`_merge`).
    """
    arrivals = pl.get_global(plgpu.SemaphoreType.REGULAR(counts_ref.shape)) if merge else None
    b, p, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    n_rows = q_smem.shape[0]
    heads = [p * n_rows + g for g in range(n_rows)]
    mode = modes_ref[b]
    rule = dict(tile_blocks=tile_blocks, split_blocks=split_blocks, min_splits=min_splits)
    for g, h in enumerate(heads):  # while the lists are read
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem.at[g], q_bar)
    if list_launch:
        meta_ref = page_table_ref
        lists = [(meta_ref[b, h, 0], meta_ref[b, h, 1]) for h in heads]
    else:  # split s's entries of row g land in list_smem[g, 0 : hi - lo)
        lists = _list_in_kernel(
            list_in_ref, page_table_ref, list_smem, meta_smem, totals_smem, b=b, p=p, s=s,
            mode=mode, seq_len=seq_lens_ref[b], block_size=block_size, page_size=page_size,
            **rule)
    rows = []
    for h, (n_listed, tail_keys) in zip(heads, lists):
        pl.when(s == 0)(functools.partial(_store_count, counts_ref, b, h, n_listed))
        size, n_splits = pallas_decode._splits(n_listed, **rule)
        lo = s * size
        hi = jnp.minimum(lo + size, n_listed)
        active = s < n_splits
        rows.append(dict(h=h, n_listed=n_listed, tail_keys=tail_keys, lo=lo, hi=hi, active=active,
                         n_splits=n_splits,
                         n_tiles=jnp.where(active, (hi - lo + tile_blocks - 1) // tile_blocks, 0),
                         alone=n_splits == 1, first=jnp.int32(0)))
    if list_launch:  # each row's share of the launch's list, from a 16-byte-aligned start
        for g, row in enumerate(rows):
            base = jnp.where(row["active"], row["lo"] // LIST_ALIGN * LIST_ALIGN, 0)
            base = pl.multiple_of(base, LIST_ALIGN)
            plgpu.copy_gmem_to_smem(
                list_in_ref.at[b, row["h"], pl.ds(base, list_smem.shape[1])], list_smem.at[g],
                list_bar)
            row["first"] = row["lo"] - base
        plgpu.barrier_wait(list_bar)
    offsets = [jnp.int32(0)]
    for row in rows:
        offsets.append(offsets[-1] + row["n_tiles"])
    n_tiles = offsets[-1]  # the program's tiles, row after row

    def locate(tile):  # (row index, the row's values, its tile) of one of the program's tiles
        g = sum((tile >= offset).astype(jnp.int32) for offset in offsets[1:-1])
        row = {name: _pick([r[name] for r in rows], g) for name in rows[0]}
        return g, row, tile - _pick(offsets[:-1], g)

    discovering = (mode == wise_modes.DISCOVER) | (mode == wise_modes.DISCOVER_UNION)
    tile_n, head_dim = k_smem.shape[1], k_smem.shape[2]

    def fetch(tile, slot):  # K and V of the tile's blocks into the slot (a missing one repeats the first)
        g, row, t = locate(tile)
        kv_head = row["h"] // group
        for j in range(tile_blocks):
            entry = t * tile_blocks + j
            entry = jnp.where(row["lo"] + entry < row["hi"], entry, 0)
            cache_block = list_smem[g, row["first"] + entry]
            keys = pl.ds(j * block_size, block_size)
            plgpu.copy_gmem_to_smem(k_ref.at[cache_block, :, kv_head], k_smem.at[slot, keys],
                                    k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[cache_block, :, kv_head], v_smem.at[slot, keys],
                                    v_bar.at[slot])

    for i in range(num_stages):
        pl.when(i < n_tiles)(functools.partial(fetch, i, i))
    plgpu.barrier_wait(q_bar)

    def store(row, m, l, acc):  # scalars m, l, acc [head_dim]
        if reuse:
            l = jnp.where(discovering, jnp.nan, l)
        _store_split(m, l, acc, acc_smem, out_smem, m_ref, l_ref, acc_ref, out_ref, b=b,
                     h=row["h"], s=s, alone=row["alone"])
        if merge:
            pl.when(jnp.logical_not(row["alone"]))(functools.partial(
                _merge, arrivals, totals_smem, extra[-1], m_ref, l_ref, acc_ref, out_ref, acc_smem,
                out_smem, b=b, h=row["h"], n_splits=row["n_splits"]))

    def store_slots(row, m, l, acc):  # l [tile_n], acc [tile_n, head_dim]: per key slot
        store(row, m, jnp.sum(l), jnp.sum(acc, axis=0))

    def accumulators():  # (max, per key slot sums [tile_n], acc [tile_n, head_dim]) of no keys
        return (jnp.float32(-jnp.inf),
                _layout(jnp.zeros((tile_n,), jnp.float32), ROW, interpret),
                _layout(jnp.zeros((tile_n, head_dim), jnp.float32), plgpu.Layout.WGMMA, interpret))

    def attend():  # the program's tiles (none: a split past the list of each of its rows)
        def q_rows(g):  # q of row g: 16-bit (mma) or scaled along the tile's keys (reduce)
            q = _layout(q_smem.at[g][...], COL, interpret)
            if products == "mma":
                return q
            return lax.broadcast_in_dim(q.astype(jnp.float32) * scale, (tile_n, head_dim), [1])

        q_first = q_rows(0) if n_rows == 1 else None
        slot_keys = _layout(lax.broadcasted_iota(jnp.int32, (tile_n,), 0), ROW, interpret)
        slot_block = slot_keys // block_size
        init = accumulators()

        def step(tile, carry):
            g, row, t = locate(tile)
            m, l, acc = carry  # scalar, [tile_n] (per key slot), [tile_n, head_dim]
            if n_rows > 1:  # a row's first tile starts afresh
                m, l, acc = lax.cond(t == 0, lambda: init, lambda: (m, l, acc))
            slot = lax.rem(tile, num_stages)
            # Scores while V lands; V is read once K is dead (fewer live registers).
            plgpu.barrier_wait(k_bar.at[slot])
            k = _layout(k_smem.at[slot][...], plgpu.Layout.WGMMA, interpret)
            first = row["lo"] + t * tile_blocks
            ok = _valid_keys(first, slot_keys, hi=row["hi"], n_listed=row["n_listed"],
                             tail_keys=row["tail_keys"], block_size=block_size)
            q = q_first if n_rows == 1 else q_rows(g)
            if products == "mma":
                scores = scores_mma(k, q) * scale
            else:
                scores = jnp.sum(k.astype(jnp.float32) * q, axis=1)
            scores = jnp.where(ok, scores, -jnp.inf)
            plgpu.barrier_wait(v_bar.at[slot])
            _zero_values_past_keys(v_smem.at[slot], ok, first, hi=row["hi"], n_listed=row["n_listed"],
                                   tail_keys=row["tail_keys"], tile_blocks=tile_blocks, block_size=block_size,
                                   interpret=interpret)
            if products == "mma":  # V's fragments for the tensor cores (a container: load_vt)
                v = load_vt(v_smem.at[slot])
            else:
                v = v_smem.at[slot][...].astype(jnp.float32)
            # Refill the slot (the copy waits for every thread's loads of it).
            pl.when(tile + num_stages < n_tiles)(functools.partial(fetch, tile + num_stages, slot))
            m_new = jnp.maximum(m, jnp.max(scores))
            m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - m_base)
            p = jnp.exp2(scores - m_base)

            pl.when(discovering)(functools.partial(
                _store_block_stats, stat_m_ref, stat_l_ref, b=b, h=row["h"], first=first,
                hi=row["hi"], tile_blocks=tile_blocks, block_m=lambda: m_base,
                block_l=lambda j: jnp.sum(jnp.where(slot_block == j, p, 0.0))))

            if products == "mma":
                acc = pv_mma(p, acc * alpha, v)
            else:
                acc = acc * alpha + lax.broadcast_in_dim(p, acc.shape, [0]) * v
            l = l * alpha + p
            if n_rows > 1:  # the row's last tile stores its split
                pl.when(t == row["n_tiles"] - 1)(lambda: store_slots(row, m_new, l, acc))
            return m_new, l, acc

        carry = lax.fori_loop(0, n_tiles, step, init)
        if n_rows == 1:  # its one row's split
            store_slots(rows[0], *carry)

    pl.when(n_tiles > 0)(attend)
    for row in rows:  # a row listing no keys: its output is NaN (the softmax of no keys)
        pl.when(row["active"] & (row["n_tiles"] == 0))(
            lambda row=row: store_slots(row, *accumulators()))


def _store_count(counts_ref, b, h, n_listed):
    counts_ref[b, h] = n_listed


def _pick(values, g):
    """values[g] for a traced g in [0, len(values))."""
    out = values[0]
    for k in range(1, len(values)):
        out = jnp.where(g == k, values[k], out)
    return out


def _list_in_kernel(support_ref, page_table_ref, list_smem, meta_smem, totals_smem, *, b, p, s,
                    mode, seq_len, block_size, page_size, tile_blocks, split_blocks, min_splits):
    """Step 1a in the split kernel, per thread (raw Mosaic GPU code: `plgpu.inline_mgpu`; the
    interpreter does not run it), for the program's rows (heads p * rows + g, rows =
    list_smem.shape[0]), 128 // rows threads a row. Thread t of row g owns its blocks [t * per,
    (t + 1) * per): it counts the ones the row lists, an inclusive scan over the warp (shuffles)
    and the row's warp totals (SMEM) give each block its list entry, and the entries of split s
    (pallas_decode._split_size of the row's count) are written to list_smem[g, entry - lo] as
    cache blocks (page-table entry * blocks a page + block within the page). Returns per row
    (n_listed, valid keys of the last entry) as `pallas_decode._list_kernel`'s meta."""
    n_rows, n_blocks = list_smem.shape[0], support_ref.shape[-1]
    row_threads = WARPGROUP // n_rows
    per = -(-n_blocks // row_threads)
    per_page = page_size // block_size

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 5 + (SCALAR,) * 5)
    def body(_, support, page_table, entries, meta, totals, b, p, s, mode, seq_len):
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()

        def c(value):
            return arith.constant(i32, value)

        def at(*values):
            return [arith.index_cast(index, v) for v in values]

        def cmp(pred, x, y):
            return arith.cmpi(getattr(arith.CmpIPredicate, pred), x, y)

        def cdiv(x, d):  # x >= 0
            return arith.divsi(arith.addi(x, c(d - 1)), c(d))

        b, p, s, mode, seq_len = map(scalar, (b, p, s, mode, seq_len))
        wg_thread = arith.remui(mgpu_utils.thread_idx(), c(WARPGROUP))
        lane, warp = arith.andi(wg_thread, c(31)), arith.shrui(wg_thread, c(5))
        g, thread = arith.divui(wg_thread, c(row_threads)), arith.remui(wg_thread, c(row_threads))
        h = arith.addi(arith.muli(p, c(n_rows)), g)
        # Every global load first, on addresses known at the start (one round trip): the
        # blocks' bits and pages.
        owned = [arith.addi(arith.muli(thread, c(per)), c(i)) for i in range(per)]
        blocks = [arith.minsi(block, c(n_blocks - 1)) for block in owned]
        bits = [memref.load(support, at(b, h, block)) for block in blocks]
        pages = [memref.load(page_table, at(b, arith.divsi(block, c(per_page)))) for block in blocks]
        n_causal = arith.minsi(cdiv(seq_len, block_size), c(n_blocks))
        every = cmp("ne", mode, c(wise_modes.SPARSE))
        # Only the last causal block can be partial; its owner stores the last entry's valid
        # keys (block 0's owner when seq_len is 0, a call that failed its checks under jit:
        # nothing is listed then and the outputs are NaN).
        last = arith.subi(n_causal, c(1))
        listed, cache_blocks, count = [], [], c(0)
        for block, own, held, page in zip(blocks, owned, bits, pages):
            cache_blocks.append(
                arith.addi(arith.muli(page, c(per_page)), arith.remsi(block, c(per_page))))
            on = arith.andi(cmp("slt", own, n_causal), arith.ori(every, held))
            listed.append(on)
            count = arith.addi(count, arith.extui(i32, on))
            with mgpu_utils.when(cmp("eq", own, arith.maxsi(last, c(0)))):
                tail = arith.subi(seq_len, arith.muli(last, c(block_size)))
                memref.store(arith.select(on, tail, c(block_size)), meta, at(g, c(1)))
        scan = count  # inclusive, over the warp
        for d in (1, 2, 4, 8, 16):
            up = shfl_up(scan, c(d), c(-1), c(0))
            scan = arith.select(cmp("sge", lane, c(d)), arith.addi(scan, up), scan)
        with mgpu_utils.when(cmp("eq", lane, c(31))):
            memref.store(scan, totals, at(warp))
        mgpu_utils.warpgroup_barrier()
        n_listed, entry = c(0), arith.subi(scan, count)
        for w in range(WARPGROUP // 32):  # the totals of the row's warps
            mine = cmp("eq", c(w * 32 // row_threads), g)
            total = arith.select(mine, memref.load(totals, at(c(w))), c(0))
            n_listed = arith.addi(n_listed, total)
            entry = arith.addi(entry, arith.select(cmp("slt", c(w), warp), total, c(0)))
        # wise_core.split_plan.split_size, as pallas_decode._split_size (a test holds the two
        # lists bitwise equal)
        n_splits = arith.maxsi(cdiv(n_listed, split_blocks), c(min_splits))
        per_split = arith.divsi(arith.addi(n_listed, arith.subi(n_splits, c(1))), n_splits)
        wanted = arith.muli(cdiv(per_split, tile_blocks), c(tile_blocks))
        size = arith.minsi(arith.maxsi(wanted, c(tile_blocks)), c(split_blocks))
        lo = arith.muli(s, size)
        hi = arith.minsi(arith.addi(lo, size), n_listed)
        for cache_block, on in zip(cache_blocks, listed):
            mine = arith.andi(cmp("sge", entry, lo), cmp("slt", entry, hi))
            with mgpu_utils.when(arith.andi(on, mine)):
                memref.store(cache_block, entries, at(g, arith.subi(entry, lo)))
            entry = arith.addi(entry, arith.extui(i32, on))
        with mgpu_utils.when(cmp("eq", thread, c(0))):
            memref.store(n_listed, meta, at(g, c(0)))
        mgpu_utils.warpgroup_barrier()

    body(support_ref, page_table_ref, list_smem, meta_smem, totals_smem, b, p, s, mode, seq_len)
    return [(meta_smem[g, 0], meta_smem[g, 1]) for g in range(n_rows)]


def _zero_values_past_keys(v_slot, ok, first, *, hi, n_listed, tail_keys, tile_blocks, block_size, interpret):
    """Zero the values of a ring slot (V [tile_n, head_dim] in SMEM) at the key slots that are
    not `ok` (bool[tile_n], ROW), in the tile of the row's last block when the row's keys end
    inside it (entries first, first + 1, ...): its slots past them hold whatever the page's last
    holder left, NaN too, and p = 0 times NaN in p.V would make the row NaN. (Slots past the
    split's entries repeat one of its blocks: the row's keys.) Committed for the products."""
    def zero():
        v = _layout(v_slot[...], plgpu.Layout.WGMMA, interpret)
        v_slot[...] = jnp.where(lax.broadcast_in_dim(ok, v.shape, [0]), v, jnp.zeros_like(v))
        plgpu.commit_smem()

    pl.when((hi == n_listed) & (first + tile_blocks >= n_listed) & (tail_keys < block_size))(zero)


def _valid_keys(first, key_slot, *, hi, n_listed, tail_keys, block_size):
    """Which key slots of a tile whose first slot holds list entry `first` attend: their entry
    is in the split ([.., hi)) and, in the list's last entry, below its tail_keys."""
    entry = first + key_slot // block_size
    return (entry < hi) & ((entry < n_listed - 1) | (key_slot % block_size < tail_keys))


def _store_block_stats(stat_m_ref, stat_l_ref, *, b, h, first, hi, tile_blocks, block_m, block_l):
    """A discovery tile's per-block stats: for its blocks j in the split (entries first + j < hi)
    (block_m(): the running max the exponentials are taken against, block_l(j): their sum)."""
    m = block_m()
    for j in range(tile_blocks):

        @pl.when(first + j < hi)
        def _store():
            stat_m_ref[b, h, first + j] = m
            stat_l_ref[b, h, first + j] = block_l(j)


def _store_split(m, l, acc, acc_smem, out_smem, m_ref, l_ref, acc_ref, out_ref, *, b, h, s,
                 alone):
    """A split's max m and sum l (scalars); its acc [head_dim] (through SMEM) or, for a row's
    only split (alone), the output acc / l itself (the finish's merge of one split)."""
    m_ref[b, h, s] = m
    l_ref[b, h, s] = l

    @pl.when(alone)
    def _output():
        out_smem[...] = (acc / l).astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[b, h])

    @pl.when(jnp.logical_not(alone))
    def _partial():
        acc_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc_smem, acc_ref.at[b, h, s])

    # Until the copy has read its SMEM source: the program may end with the GMEM writes in
    # flight (the launch's end orders them before the next one).
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _merge(arrivals, slot_smem, bar, m_ref, l_ref, acc_ref, out_ref, acc_smem, out_smem, *, b, h,
           n_splits):
    """After a split of a row of n_splits stored its partials: count it in (`arrive`); the last
    split to arrive merges the row's splits as pallas_decode's finish does (weights exp2(m_j -
    max m), out = sum_j w_j acc_j / sum_j w_j l_j, summed split after split: the same result
    within f32 rounding, not bitwise), each acc_j copied through acc_smem."""
    plgpu.wait_smem_to_gmem(0)  # this split's acc written, not only read
    last = arrive(arrivals, slot_smem, b=b, h=h) == n_splits - 1

    @pl.when(last)
    def _merged():
        m_top = lax.fori_loop(0, n_splits, lambda j, m: jnp.maximum(m, m_ref[b, h, j]),
                              jnp.float32(-jnp.inf))

        def add(j, carry):  # the copy waits for every thread's reads of acc_smem (auto barrier)
            total, acc = carry
            plgpu.copy_gmem_to_smem(acc_ref.at[b, h, j], acc_smem, bar)
            plgpu.barrier_wait(bar)
            weight = jnp.exp2(m_ref[b, h, j] - m_top)
            return (total + weight * l_ref[b, h, j],
                    acc + weight * plgpu.layout_cast(acc_smem[...], COL))

        zeros = plgpu.layout_cast(jnp.zeros(acc_smem.shape, jnp.float32), COL)
        total, acc = lax.fori_loop(0, n_splits, add, (jnp.float32(0.0), zeros))
        out_smem[...] = (acc / total).astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[b, h])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _split_call(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size, scale,
                config: MosaicConfig, reuse, interpret):
    batch, heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    n_blocks = support.shape[-1]
    rule = config.split_rule()
    tile_blocks, split_blocks = rule.tile_blocks(block_size), rule.split_blocks(block_size)
    list_launch = config.list_launch or interpret is not None
    products = "reduce" if interpret is not None and config.products == "mma" else config.products
    if list_launch:
        list_len = -(-(split_blocks + LIST_ALIGN - 1) // LIST_CHUNK) * LIST_CHUNK  # a split's share from base
        row_len = -(-(n_blocks + list_len) // LIST_CHUNK) * LIST_CHUNK  # TMA: 16-byte row strides
        row_len = max(row_len, pallas_decode._next_pow2(n_blocks))  # the list kernel's scatter slots
        list_refs = pallas_decode._list_call(page_table, seq_lens, modes, support,
                                             block_size=block_size, page_size=page_size,
                                             row_len=row_len, interpret=interpret is not None)
    else:
        list_len, list_refs = split_blocks, (support, page_table)
    blocks_pad = max(pallas_decode._next_pow2(n_blocks), tile_blocks)
    max_splits = rule.max_splits(block_size, n_blocks)
    splits_pad = pallas_decode._next_pow2(max_splits)
    tile_n = tile_blocks * block_size
    f32 = jnp.float32
    out_type = [jax.ShapeDtypeStruct((batch, heads, blocks_pad), f32),  # stat_m
                jax.ShapeDtypeStruct((batch, heads, blocks_pad), f32),  # stat_l
                jax.ShapeDtypeStruct((batch, heads, splits_pad, head_dim), f32),  # acc
                jax.ShapeDtypeStruct((batch, heads, splits_pad), f32),  # m
                jax.ShapeDtypeStruct((batch, heads, splits_pad), f32),  # l
                jax.ShapeDtypeStruct((batch, heads), jnp.int32),  # counts
                jax.ShapeDtypeStruct((batch, heads, head_dim), q.dtype)]  # out (rows of one split)
    stages, rows = config.num_stages, config.rows
    scratch = [plgpu.SMEM((rows, list_len), jnp.int32), plgpu.SMEM((rows, 2), jnp.int32),
               plgpu.SMEM((WARPGROUP // 32,), jnp.int32),
               plgpu.SMEM((rows, head_dim), q.dtype),
               plgpu.SMEM((stages, tile_n, head_dim), k_pages.dtype, transforms=TILED),
               plgpu.SMEM((stages, tile_n, head_dim), v_pages.dtype, transforms=TILED),
               plgpu.SMEM((head_dim,), f32), plgpu.SMEM((head_dim,), q.dtype),
               plgpu.Barrier(num_arrivals=rows), plgpu.Barrier(num_arrivals=rows),
               plgpu.Barrier(num_arrivals=tile_blocks, num_barriers=stages),
               plgpu.Barrier(num_arrivals=tile_blocks, num_barriers=stages)]
    merge = reuse and interpret is None  # the interpreter has no semaphores: the finish merges
    if merge:
        scratch.append(plgpu.Barrier(num_arrivals=1))
    kernel = functools.partial(
        _split_kernel, block_size=block_size, page_size=page_size, tile_blocks=tile_blocks,
        split_blocks=split_blocks, min_splits=rule.min_splits, num_stages=stages,
        group=heads // kv_heads, scale=scale * LOG2E, products=products, list_launch=list_launch,
        reuse=reuse, merge=merge, interpret=interpret is not None)
    cache_blocks = num_pages * page_size // block_size
    k_rows = k_pages.reshape(cache_blocks, block_size, kv_heads, head_dim)
    v_rows = v_pages.reshape(cache_blocks, block_size, kv_heads, head_dim)
    partials = plgpu.kernel(
        kernel, out_type=out_type, grid=(max_splits, batch, heads // rows),
        grid_names=("s", "b", "h"),  # the last name varies fastest: every row's split 0 first
        scratch_types=scratch, interpret=interpret,
    )(modes, seq_lens, *list_refs, q, k_rows, v_rows)
    *partials, counts, out = partials
    return (None, *partials), counts, out, merge  # pallas_decode's partials (not its list output)


@functools.partial(jax.jit, static_argnames=("block_size", "eta", "scale", "all_blocks",
                                             "return_mass", "config", "reuse", "interpret"))
def _decode(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size, eta, scale,
            all_blocks, return_mass, config, reuse, interpret):
    partials, counts, out, merged = _split_call(
        q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size,
        scale=scale, config=config, reuse=reuse, interpret=interpret)
    if not merged:
        out, *finished = pallas_decode._finish_call(
            seq_lens, modes, support, partials, head_dim=q.shape[-1], out_dtype=q.dtype, block_size=block_size,
            config=config.split_rule(), eta=eta, all_blocks=all_blocks, return_mass=return_mass,
            interpret=interpret is not None, counts=counts, out=out)
        if not reuse:
            return (out, *finished)
    # a reuse call: support' is the support held, no row's mass
    return (out, support) + ((jnp.zeros(support.shape, jnp.float32),) if return_mass else ())


# ---------------------------------------------------------------------------------------------
# Public API


def interpret_params():
    """The interpreter that runs the Mosaic GPU kernel on a CPU (jax's private GPU interpreter)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size,
                     eta, scale=None, return_mass=False, interpret=None, all_blocks=False,
                     config: MosaicConfig | None = None, reuse: bool = False,
                     validate: bool = True):
    """`wise_jax.kernels.pallas_decode.decode_attention`'s contract with the split kernel on
    Mosaic GPU (module docstring). interpret: run the split kernel in jax's GPU interpreter and
    the finish in the Pallas interpreter (default: when the default backend is not a GPU).
    config: launch parameters (default `launch_config`'s). reuse: a call of WISE's reuse loops
    (`wise_jax.attention.decode_attention`: rows SPARSE or DENSE, checked with validate;
    support' is the support held): `launch_config`'s launch for it (heads grouped, bitwise the
    same outputs, or longer splits, the same within rounding), and on a GPU the last split of
    a row to arrive merges its splits (`_merge`), with no finish launch; a DISCOVER row's output
    is then NaN (when not validated). Needs 16-bit q/K/V and head_dim a multiple of 64
    (`supports`)."""
    seq_lens = check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support,
                          block_size=block_size, eta=eta, validate=validate, reuse=reuse)
    head_dim = q.shape[-1]
    if not supports(head_dim, q.dtype):
        raise ValueError(f"the Mosaic GPU kernel needs 16-bit q/K/V and head_dim a multiple of 64, "
                         f"got {jnp.dtype(q.dtype).name} and head_dim {head_dim}")
    if block_size % 8:
        raise ValueError(f"the Mosaic GPU kernel needs block_size a multiple of 8, got {block_size}")
    if scale is None:
        scale = head_dim ** -0.5
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if config is None:
        config = launch_config(q.shape[0], q.shape[1], support.shape[-1], block_size=block_size,
                               reuse=reuse, n_sm=sm_count(interpret))
    if q.shape[1] % config.rows:
        raise ValueError(f"MosaicConfig.rows ({config.rows}) must divide the heads ({q.shape[1]})")
    return tuple(_decode(
        q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size,
        eta=float(eta), scale=float(scale), all_blocks=bool(all_blocks),
        return_mass=bool(return_mass), config=config, reuse=bool(reuse),
        interpret=interpret_params() if interpret else None))
