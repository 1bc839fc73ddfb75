"""Raw Mosaic GPU code for `wise_jax.kernels.mosaic_decode`'s split kernel: inline PTX and
MLIR built inside `plgpu.inline_mgpu` bodies, for what Pallas on Mosaic GPU does not expose.

- `scalar`, `shfl_up`: a splat argument as an i32, a warp shuffle up (the in-kernel list's scan).
- `arrive`: one split of a row counted in, with acq_rel semantics (the in-kernel merge).
- `scores_mma`, `load_vt`, `pv_mma`: a tile's q.K and p.V on tensor cores, mma.sync m16n8k16 a
  warp (`MosaicConfig(products="mma")`).

None of it runs in jax's GPU interpreter; the gpu tests of `tests/wise_jax/test_mosaic_decode.py` cover it
and its CPU lowering tests build it.
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, nvvm, vector

TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 16-bit, 128-byte rows
ROW = plgpu.Layout.WGMMA.reduce(1)  # [keys]: one value per key slot of a tile
COL = plgpu.Layout.WGMMA.reduce(0)  # [head_dim]
WARPGROUP = 128  # threads of a program
SCALAR = plgpu.Layout.WG_SPLAT(shape=())  # a scalar passed to inline Mosaic GPU code


def scalar(x):
    """A SCALAR (splat) argument of inline Mosaic GPU code as an i32 value."""
    x = x.registers.item()
    return arith.index_cast(ir.IntegerType.get_signless(32), x) if isinstance(x.type, ir.IndexType) else x


def shfl_up(value, distance, mask, clamp):
    """nvvm.shfl_sync in up mode (jaxlib 0.10 and 0.11 name its parameters differently)."""
    if next(iter(inspect.signature(nvvm.shfl_sync).parameters)) == "thread_mask":
        return nvvm.shfl_sync(mask, value, distance, clamp, nvvm.ShflKind.up, results=[value.type])
    return nvvm.shfl_sync(value.type, mask, value, distance, clamp, nvvm.ShflKind.up)


def _shfl_idx(value, lane):
    """value of another lane of the warp (an f32 through shfl.sync.idx)."""
    i32 = ir.IntegerType.get_signless(32)
    out = llvm.inline_asm(i32, [mgpu_utils.bitcast(value, i32), lane],
                          "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r",
                          has_side_effects=True)
    return mgpu_utils.bitcast(out, value.type)


def arrive(arrivals, slot_smem, *, b, h):
    """Count one split of row (b, h) in: returns how many had arrived before it. Raw Mosaic GPU
    code, the release / acquire pattern of a split-K semaphore: every thread fences its stores
    (the TMA proxy's too), one thread adds to arrivals[b, h] (int32 [batch, heads], zeroed per
    launch) with acq_rel semantics at GPU scope, the count reaches the warpgroup through
    slot_smem[0], and every thread fences again before it reads what other splits stored."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), SCALAR, SCALAR))
    def body(_, arrivals, slot, b, h):
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        void = ir.Type.parse("!llvm.void")

        def fence(order):
            llvm.inline_asm(void, [], order, "", has_side_effects=True)

        b, h = scalar(b), scalar(h)
        heads = ir.MemRefType(arrivals.type).shape[1]
        fence("fence.proxy.async.global;\n\tfence.acq_rel.gpu;")
        mgpu_utils.warpgroup_barrier()
        wg_thread = arith.remui(mgpu_utils.thread_idx(), arith.constant(i32, WARPGROUP))
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, wg_thread, arith.constant(i32, 0))):
            row = arith.addi(arith.muli(b, arith.constant(i32, heads)), h)
            address = arith.addi(llvm.ptrtoint(i64, mgpu_utils.memref_ptr(arrivals)),
                                 arith.muli(arith.extui(i64, row), arith.constant(i64, 4)))
            before = llvm.inline_asm(i32, [address], "atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;",
                                     "=r,l", has_side_effects=True)
            memref.store(before, slot, [arith.constant(ir.IndexType.get(), 0)])
        mgpu_utils.warpgroup_barrier()
        fence("fence.acq_rel.gpu;\n\tfence.proxy.async.global;")

    body(arrivals, slot_smem, b, h)
    return slot_smem[0]


# Raw Mosaic GPU: a tile's products on tensor cores, mma.sync m16n8k16 a warp (products="mma").
# Warp w of the warpgroup owns key slots [16 w, 16 w + 16) of each 64 (the WGMMA layout's rows),
# and in that layout a thread (lane 4 g + t) holds slots 16 w + g and 16 w + 8 + g, columns
# 8 j + 2 t and + 1: the fragments of mma.sync's A and C (PTX ISA, "Matrix Fragments for
# mma.m16n8k16"). q.K: K [16 slots, head_dim] @ q^T (q in every column of B) accumulates the
# slots' scores in C's rows. p.V: p (row 0 of A, zeros elsewhere) @ V [16 slots, head_dim] adds
# the warp's share of p.V to row 0 of its rows of acc [tile_n, head_dim] (the others stay 0), so
# acc summed over the slots is the split's p.V, as with the reductions.


def _regs(x, *shape):
    """A FragmentedArray's registers as [*shape] (WGMMA [tile_n, n]: [tile_n // 64, n // 8, 2]
    by (64 slots, 8 columns, the thread's two slots); ROW [tile_n]: [tile_n // 64, 2]; COL [n]:
    [n // 8])."""
    return x.registers.reshape(shape)


def _element(x, i):
    """Element i of a register (a vector)."""
    return vector.extract(x, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))


def _vector(*values):
    """A register vector of the values."""
    out = llvm.mlir_undef(ir.VectorType.get((len(values),), values[0].type))
    for i, value in enumerate(values):
        out = llvm.insertelement(out, value, position=arith.constant(ir.IntegerType.get_signless(32), i))
    return out


def _i32(x):
    """A register of two 16-bit values as i32 (an mma operand)."""
    return mgpu_utils.bitcast(x, ir.IntegerType.get_signless(32))


def _ptx_type(dtype: ir.Type) -> str:
    return "bf16" if dtype == ir.BF16Type.get() else "f16"


def _mma(c, a, b, ptx_type):
    """One warp's m16n8k16 product: 4 f32 c + A (4 i32 of two 16-bit) @ B (2 i32) -> 4 f32."""
    f32 = ir.F32Type.get()
    operands = lambda first, n: "{" + ",".join(f"${first + i}" for i in range(n)) + "}"
    ptx = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32 {operands(0, 4)}, "
           f"{operands(4, 4)}, {operands(8, 2)}, {operands(10, 4)};")
    out = llvm.inline_asm(llvm.StructType.get_literal([f32] * 4), [*a, *b, *c], ptx,
                          "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False)
    return [llvm.extractvalue(f32, out, [i]) for i in range(4)]


def scores_mma(k, q):
    """scores [tile_n] f32 (ROW) = K [tile_n, head_dim] (WGMMA, 16-bit) . q [head_dim] (COL,
    16-bit), per warp head_dim / 16 steps of mma.sync in two chains (even, odd steps)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, COL),
                       return_type=plgpu.ShapeDtypeStruct(k.shape[:1], jnp.float32, layout=ROW))
    def body(_, k, q):
        tile_n, head_dim = k.shape
        f32 = ir.F32Type.get()
        ptx_type = _ptx_type(k.mlir_dtype)
        k_regs, q_regs = _regs(k, tile_n // 64, head_dim // 8, 2), _regs(q, head_dim // 8)
        zero = arith.constant(f32, 0.0)
        out = np.empty((tile_n // 64, 2), dtype=object)
        for i in range(tile_n // 64):
            chains = [[zero] * 4, [zero] * 4]
            for step in range(head_dim // 16):
                j = 2 * step
                a = [_i32(k_regs[i, j, 0]), _i32(k_regs[i, j, 1]), _i32(k_regs[i, j + 1, 0]),
                     _i32(k_regs[i, j + 1, 1])]
                b = [_i32(q_regs[j]), _i32(q_regs[j + 1])]
                chains[step % 2] = _mma(chains[step % 2], a, b, ptx_type)
            # C's rows are the warp's slots g (c0) and 8 + g (c2); its columns all equal
            for h, r in enumerate((0, 2)):
                out[i, h] = _vector(arith.addf(chains[0][r], chains[1][r]))
        registers = out.reshape(ROW.to_mgpu().registers_shape((tile_n,)))
        return mgpu_fa.FragmentedArray(_registers=registers, _layout=ROW.to_mgpu(), _is_signed=None)

    return body(k, q)


def load_vt(v_slot):
    """V's B fragments for `pv_mma` from one ring slot (SMEM [tile_n, head_dim], 16-bit, TILED):
    ldmatrix.x4.trans a warp per 16 slots x 16 columns, returned in a [tile_n, head_dim] WGMMA
    array used as a container (register [i, j, h] holds B's half h of columns [8 j, 8 j + 8) of
    the warp's slots in 64-slot group i; the array's elements mean nothing else)."""
    tile_n, head_dim = v_slot.shape

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(TILED),),
                       return_type=plgpu.ShapeDtypeStruct((tile_n, head_dim), v_slot.dtype,
                                                          layout=plgpu.Layout.WGMMA))
    def body(_, v):
        i32 = ir.IntegerType.get_signless(32)
        c = lambda value: arith.constant(i32, value)
        base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(v))
        thread = arith.remui(mgpu_utils.thread_idx(), c(WARPGROUP))
        lane, warp = arith.andi(thread, c(31)), arith.shrui(thread, c(5))
        matrix, row = arith.shrui(lane, c(3)), arith.andi(lane, c(7))  # lane 8 m + r: row r of matrix m
        # Matrix m: slots + 8 (m % 2), columns + 8 (m // 2); a row is 8 16-bit values (16 bytes).
        # TILED: [8, 64] tiles of 1 KiB in row-major order, 128-byte rows, 16-byte chunk x of row
        # r stored at chunk x ^ r (r = slot % 8).
        slot_tile = arith.addi(arith.muli(warp, c(2)), arith.andi(matrix, c(1)))  # (slot // 8) % 8
        col_half = arith.shrui(matrix, c(1))
        col_tiles = head_dim // 64
        bf = ir.VectorType.get((2,), ir.MemRefType(v.type).element_type)
        regs = np.empty((tile_n // 64, head_dim // 8, 2), dtype=object)
        for i in range(tile_n // 64):
            for n16 in range(head_dim // 16):
                chunk = arith.addi(c(2 * n16 % 8), col_half)  # the 16-byte chunk in its tile row
                tile = arith.addi(arith.muli(arith.addi(c(8 * i), slot_tile), c(col_tiles)),
                                  c(2 * n16 // 8))
                offset = arith.addi(arith.addi(arith.muli(tile, c(1024)), arith.muli(row, c(128))),
                                    arith.muli(arith.xori(chunk, row), c(16)))
                out = llvm.inline_asm(
                    llvm.StructType.get_literal([i32] * 4), [arith.addi(base, offset)],
                    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0,$1,$2,$3}, [$4];",
                    "=r,=r,=r,=r,r", has_side_effects=True)
                d = [mgpu_utils.bitcast(llvm.extractvalue(i32, out, [m]), bf) for m in range(4)]
                regs[i, 2 * n16] = d[0], d[1]
                regs[i, 2 * n16 + 1] = d[2], d[3]
        layout = plgpu.Layout.WGMMA.to_mgpu()
        return mgpu_fa.FragmentedArray(_registers=regs.reshape(layout.registers_shape((tile_n, head_dim))),
                                       _layout=layout, _is_signed=None)

    return body(v_slot)


def pv_mma(p, acc, v):
    """acc [tile_n, head_dim] f32 (WGMMA) + p [tile_n] f32 (ROW) . V, V's fragments from
    `load_vt` (v): each warp gathers its 16 slots' p as row 0 of A (shuffles; rounded to V's
    dtype), the other rows 0, and runs head_dim / 8 mma.sync."""

    @plgpu.inline_mgpu(arg_types=(ROW, plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
                       return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32,
                                                          layout=plgpu.Layout.WGMMA))
    def body(_, p, acc, v):
        tile_n, head_dim = acc.shape
        i32 = ir.IntegerType.get_signless(32)
        c = lambda value: arith.constant(i32, value)
        ptx_type = _ptx_type(v.mlir_dtype)
        half2 = ir.VectorType.get((2,), v.mlir_dtype)
        lane = arith.andi(mgpu_utils.thread_idx(), c(31))
        group, pair = arith.shrui(lane, c(2)), arith.andi(lane, c(3))
        first = arith.muli(pair, c(8))  # lane of slot 2 t (g = 2 t); slot 2 t + 1: lane + 4
        row0 = arith.cmpi(arith.CmpIPredicate.eq, group, c(0))
        p_regs = _regs(p, tile_n // 64, 2)
        acc_regs, v_regs = _regs(acc, tile_n // 64, head_dim // 8, 2), _regs(v, tile_n // 64, head_dim // 8, 2)
        out = np.empty(acc_regs.shape, dtype=object)
        for i in range(tile_n // 64):
            a = []
            for half in (0, 1):  # A's columns [8 half, 8 half + 8): slots 8 half + 2 t, + 1
                value = _element(p_regs[i, half], 0)
                pair_p = [_shfl_idx(value, lane_src) for lane_src in (first, arith.addi(first, c(4)))]
                packed = _i32(arith.truncf(half2, _vector(*pair_p)))
                a.append(arith.select(row0, packed, c(0)))
            a = [a[0], c(0), a[1], c(0)]  # rows g and 8 + g of A: p in row 0 only
            for j in range(head_dim // 8):
                cs = [_element(acc_regs[i, j, h], e) for h in (0, 1) for e in (0, 1)]
                d = _mma(cs, a, [_i32(v_regs[i, j, 0]), _i32(v_regs[i, j, 1])], ptx_type)
                out[i, j] = _vector(d[0], d[1]), _vector(d[2], d[3])
        return mgpu_fa.FragmentedArray(_registers=out.reshape(acc.registers.shape), _layout=acc.layout,
                                       _is_signed=None)

    return body(p, acc, v)
