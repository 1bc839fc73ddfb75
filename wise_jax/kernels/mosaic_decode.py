"""Paged split-KV decode attention with per-row WISE modes, the split kernel on Mosaic GPU.

The contract and the split rule are `wise_jax.kernels.pallas_decode`'s (its docstring); this
module runs the heavy part, the split kernel that reads the keys and values, as a Mosaic GPU
kernel (`plgpu`, Hopper: TMA copies into a multi-stage shared-memory ring, mbarriers), for
16-bit q/K/V with head_dim a multiple of 64. A call is two launches, as the Triton kernel's, or
one for a reuse call on a GPU (3. below):

1. Split kernel (Mosaic GPU), grid (max_splits, batch, heads / rows), split-major (programs
   start in grid order, the last axis fastest: every row's first split before any second, so a
   sparse call's programs for splits its rows do not have come last), one warpgroup per
   program, which attends split s of `MosaicConfig.rows` consecutive heads (1 by default; with
   more, steps a and b below run for each, 128 / rows threads listing each row and the rows'
   tiles one after another through the one ring).
   a. List (`_list_in_kernel`): Pallas on Mosaic GPU has no prefix sum, so this step is raw
      Mosaic GPU code (`plgpu.inline_mgpu`), per thread: thread t owns blocks [t * per,
      (t + 1) * per) of the row; it reads their support bits and page-table entries (one
      round trip to memory, while q's copy is in flight), counts the blocks the row lists
      (every causal block, or the causal blocks of a SPARSE head's support), and an inclusive
      scan over the warp (shuffles) plus the four warp totals (shared memory) number them;
      split `s` keeps list entries [s * split_size, ...) as in pallas_decode (same
      `split_size`, so a SPARSE row selecting every block has DENSE's splits) as cache block
      indices in shared memory. Split 0 stores the row's count for the finish.
   b. Attend: `tile_n` keys at a time (tile_n / 32 blocks, one TMA copy of [32, head_dim] per
      block, for K and for V, from the cache viewed as [cache blocks, 32, kv_heads,
      head_dim], so the dynamic index is on an untiled dimension) through `num_stages` slots,
      each tile's products by `MosaicConfig.products`: layout-hinted reductions (scores = sum
      over head_dim of K in the WGMMA register layout times q broadcast along the keys; acc[key
      slot, :] += p * V row-wise) or tensor-core mma.sync a warp (`_scores_mma`, `_pv_mma`:
      the same scores and acc, the probabilities rounded to V's dtype for the product); an
      online softmax in base 2 whose running max is the tile maximum; acc reduced over the key
      slots once at the end of the split. Discovery rows store per block (its running
      max, its sum of exponentials); outputs are computed as for DENSE, so DISCOVER is bitwise
      DENSE, and a SPARSE row with every block selected has DENSE's list, splits and
      arithmetic. A split stores its (max, sum) and either its acc (the row has more splits)
      or, for a row's only split, the output acc / sum itself (whatever the mode: the choice
      depends on the list length only, so the bitwise equalities hold).
2. Finish: `pallas_decode`'s finish kernel (merge by maxima, mass, selection by sort + prefix
   sum, support'), reading this kernel's partials in the same layout and its counts (no
   recount of the support), leaving the output of rows of one split as the split kernel wrote
   it (the two launches' `out` is one buffer: an input-output alias).
3. Reuse calls (`reuse=True`, WISE's reuse loops: rows SPARSE or DENSE, which need no mass and
   no selection): on a GPU no finish launch. A row's only split writes its output (as above);
   each split of a row of several stores its partials and counts itself in (`_arrive`: one
   thread's atomic add with acq_rel semantics on a per-row count in GMEM, `pl.get_global`
   semaphores, which Mosaic GPU zeroes each launch), and the one that arrives last merges the
   row's partials (`_merge`, the finish's formula summed split after split: within f32
   rounding of the finish's merge, not bitwise). support' is the support held, the mass zeros.
   jax's GPU interpreter has no semaphores: interpreted, the finish merges.

Interpreted (jax's GPU interpreter on a CPU), the list is `pallas_decode._list_kernel`, a
Triton-lowered launch of its own that the split kernel copies its share from (a TMA copy from
a 16-byte-aligned start), and the products are the reductions: the interpreter does not run
inline Mosaic GPU code. `MosaicConfig(list_launch=True)` takes that route on a GPU too; a gpu
test holds the two routes' outputs bitwise equal in every mode, for both products. The mma
products and the in-kernel merge of reuse calls are covered by gpu tests only (against the
float64 references, the Triton-lowered kernel, the finish's merge, and bitwise across list
routes, rows and reuse launches).

Routes tried (lowered with jax 0.10.2 on a CPU machine; run with jax 0.11.2 on an H200):
- Layout-hinted reductions (above, the default): lower to Mosaic GPU for sm90
  (`jax.jit(...).lower(lowering_platforms=("cuda",))` builds the Mosaic GPU module: layouts,
  TMA and barrier lowering are checked then; PTX generation happens in the CUDA plugin at
  compile time, not here), and run in jax's GPU interpreter (`InterpretGPUParams`): the CPU
  tests run this kernel there at small shapes. Layout casts are skipped when interpreted (the
  interpreter has no rule for them; they only pin register layouts). Two fixes came from the
  H200: the K/V copies index the cache as [cache blocks, 32, kv_heads, head_dim] (sm90 layout
  inference rejected a dynamic row offset on the tiled rows dimension), and each split copies
  its share of the block list from a 16-byte-aligned start (a misaligned TMA source was an
  illegal instruction).
- q.K and p.V on tensor cores through mma.sync m16n8k16, one warp per 16 key slots
  (`products="mma"`, raw Mosaic GPU code: inline PTX for mma.sync, ldmatrix.trans and shfl;
  2026-12-03, h200-2026-12-03/mma/): q.K as K [16 slots, head_dim] @ q^T with q in every column
  of B, so K's registers as loaded in the WGMMA layout are A's fragments and C's rows are the
  slots' scores in the layout the softmax reads; p.V as p (row 0 of A, gathered by four
  shuffles) @ V [16 slots, head_dim] (ldmatrix.x4.trans from the swizzled ring slot) into
  the warp's rows of acc. It passes every gpu test (bitwise equalities included) and ptxas takes
  162 registers (the reductions 213-245). Same run against the reductions: sparse at 13 %
  25.5 / 32.5 / 31.9 us against 28.8 / 33.2 / 32.9 (1K x 64 with rows=4 against rows=1 / 4K x
  20 / 8K x 10), dense 131.3 / 159.6 / 159.9 against 128.1 / 158.2 / 158.1. Kept for calls
  hinted mostly SPARSE, now reuse calls (`launch_config`); plain calls keep the reductions. In that run's
  sweep (sweep/), with the mma products: 2048-key splits 25.6 / 31.7 / 30.4 us sparse (the
  grid's programs for splits a sparse row never has are fewer: each lists its row before it
  finds it has nothing to do; kept for hinted calls past one split), min_splits=2 34.6 / 31.3 /
  32.2, three stages 29.4 / 32.9 / 32.9, rows=2 29.3 / 35.0 / 35.5 (with three stages 30.2 /
  37.3 / 37.3).
- q.K and p.V as `wgmma` (q in row 0 of a 64-row tile in shared memory, K^T through
  `plgpu.transpose_ref`, p in registers): `MosaicConfig(dots=True)`. It passes the gpu tests
  but is slower: dense 132.5 / 163.9 / 164.3 us against 128.0 / 158.4 / 158.4, sparse 32.4 /
  40.6 / 38.1 against 29.0 / 35.2 / 34.3 (1K x 64 / 4K x 20 / 8K x 10). jax's GPU interpreter
  takes wgmma operands only as plainly sliced shared-memory refs, so the CPU tests cannot run it.
- Skipping the accumulator's rescale when the running max did not rise (a `lax.cond`), and
  one explicit barrier per refill in place of the automatic one per copy
  (`unsafe_no_auto_barriers`): neither changed the time (within 1 %), so neither was kept; the
  first is also not bitwise the plain update on the GPU (the compiler contracts the two
  branches differently).
- The grid split-major (kept; h200-2026-12-03/grid-order/): Mosaic GPU starts programs in grid
  order with the last axis fastest, so with (batch, heads, splits) a row's programs for splits
  it does not have (most of a sparse call's) came between the working ones and held slots while
  they listed their rows. With (splits, batch, heads), same run, fresh process each, mma
  products: sparse at 13 % 30.4 / 28.8 us against 31.7 / 30.0 (4K x 20 / 8K x 10, 2048-key
  splits), 30.4 / 30.4 against 32.1 / 31.8 with 1024-key splits; dense within 0.7 us. Then
  (sweep/) 4096-key splits with min_splits 2 or 3 (no empty programs, two or three working ones
  a row) 29.8 / 32.3 us at 8K x 10 against 29.0, three stages 31.3-31.8: one split of a sparse
  row per program stays fastest.
- A persistent grid (commit 42c5351, `MosaicConfig(persistent=N)`, removed after): N programs
  an SM, each a stream of the call's splits through one ring, the next split's q and first
  tiles copied while the current one finishes, the list read from GMEM as scalars. Bitwise the
  grid kernel (interpreter and H200), no faster in dense and slower in sparse (4K x 20: 40.2
  against 35.8 us; 1K x 64 with min_splits=2: 41.6 against 30.3): one warpgroup serialises
  each split's scalar loads (its row's metadata, its list entries), which the grid kernel's
  many programs overlap.
- A running max per key slot (no reduction across the warpgroup per tile; the split merges its
  64 slots once): no change (sparse 31.1 / 36.5 / 35.2 us). q.K and p.V over head_dim in
  64-column chunks: ptxas allocates 213 registers either way, times within 0.7 us.
  (benchmarks/results/h200-2026-12-02/ has these runs.)
- p.V summed over each tile's keys (acc [head_dim], a cross-warp reduction a tile, to free the
  64 accumulator registers a thread; h200-2026-12-02/tile-sums/): ptxas still took 209 registers,
  and dense / sparse slowed to 161-203 / 35-53 us.

- The list in the split kernel (`_list_in_kernel`, the default; h200-2026-12-02/list-in-kernel/,
  list-in-kernel-final/): the list launch's ~2 us gone, the split kernel 0.2-1.8 us longer (its
  programs now read the support and the page table before their first copies). Same run
  against the list launch of the day before: dense 128.1 / 157.8 / 158.0 us against 132.4 /
  163.0 / 163.1, sparse 29.5 / 34.0 / 33.1 against 31.2 / 36.9 / 35.5.
- A quarter split of slack in the split rule (a remainder of up to split_blocks // 4 blocks
  spread over the other splits: 33 blocks one split, not 18 + 15; h200-2026-12-02/tail-merge/,
  `variant.diff`, not kept): slower where it saves programs the call needs to fill the SMs
  (8K x 10 sparse 34.9 against 33.1 us: 160 programs; the Triton-lowered kernel's sparse 44.5 /
  42.0 against 40.3 / 39.0 at 4K / 8K).
- The output of a row's only split written by the split kernel (kept; h200-2026-12-02/
  single-split-outputs/): the finish's profile at 4K x 20 sparse 2.5 against 3.0 us, elsewhere
  within 0.2 us; the call times within the run-to-run spread (sparse 30.2 / 33.5 / 33.0, dense
  128.1 / 157.9 / 158.1 us).
- The last block's bit taken from its owner thread's load (not a second load that waited on
  seq_len's), and the acc copy waited for only until it has read SMEM (kept, one dependent load
  and one wait fewer; h200-2026-12-02/list-loads/): the split kernel's profile unchanged (sparse
  27.3 / 30.6 / 29.5 us), so the chain that bounds sparse is not in these.
- The split rule swept again (h200-2026-12-02/list-loads/, split-sweep/): `min_splits=3` makes 8K
  x 10 sparse 32.1 us against 32.9 (three splits of 12 / 12 / 9 blocks) and 1K / 4K sparse
  slower (46.3 / 35.2 against 29.9 / 33.3); `split_keys=512`, with two or three stages, is slower
  at every shape (sparse 33.5-37.7 us); `min_splits=2` and `num_stages=3` within 0.3 us.
- Several heads a program (`MosaicConfig(rows=2 or 4)`, kept as a launch setting; each head keeps
  its splits and arithmetic, so every output is bitwise that of rows=1; h200-2026-12-02/rows/):
  with rows=4, 1K x 64 sparse 27.7 us against 29.8 (0.962x the Triton kernel's 28.8: 256
  programs of about ten tiles, one wave, in place of 1,024 of two or three), but dense there
  131.2 against 127.7, and at 4K x 20 / 8K x 10 (a quarter of the programs) dense 224.7 / 223.6
  and sparse 64.9 / 66.1; rows=2: 1K x 64 sparse 29.5, dense 128.8, 4K / 8K sparse 36.9 / 37.2.
  One launch serves dense and sparse rows alike, so the default stays 1; a caller that knows
  its rows are mostly SPARSE (a reuse call, `reuse=True`) gets `launch_config`'s
  rows, more than 1 only where every row is one split and the programs' waves favour it (its
  docstring has the sweep, h200-2026-12-02/rows-choice/; min_splits 3 or 6 with rows 2 or 4,
  to even out 4K x 20 / 8K x 10's waves, was slower everywhere: sparse 35.1-49.2 us there).

What bounds it: for the reductions, the work in the SM, not memory (below); the mma products cut
that work (no per-element conversions; 162 registers) yet took sparse down by only 0.7-3.3 us
(h200-2026-12-03/mma/), and the longer splits of hinted calls by 0.8-1.5 us more, the grid
split-major by 1.2-1.3 us and the finish launch dropped for reuse calls by ~2 us more
(h200-2026-12-03/grid-order/, reuse/): what is left is
per program (its list, read before anything else, then its first copies' latency, at two or three
programs an SM) and the programs of a grid sized for DENSE rows, which a sparse row mostly leaves
empty. With the reductions: with every page-table entry 0 (K/V from L2, no
HBM traffic; h200-2026-12-02/l2-floor/) sparse takes 28.3 / 27.6 / 23.7 us against 33.4 / 32.8 /
29.1 from scattered pages (4K x 20 / 8K x 10 / 1K x 64), dense 96.8 / 95.6 / 77.7 against 159.8 /
160.3 / 129.4, and a third stage changes neither: a 64-key tile is about 590 PTX instructions a
thread (K and V converted to f32 element by element, 128 cvt, then ~250 f32 operations), where the
Triton kernel's tl.dot runs the tile on tensor cores (mma.sync, q padded to 16 rows); Pallas on
Mosaic GPU exposes wgmma only (64-row M: `dots` above, slower). Earlier (H200, Nsight Compute on
the sparse call at 4K x 20, 13 %, with the list launch): 233 registers a thread (no spills) and 70.7 KB of shared memory a program allow two
programs (8 warps) an SM, 12.5 % occupancy; the call's 320 listed splits fill 264 slots and a
partial second wave, so the SMs are busy 70 % of the kernel's time, at 2.6 TB/s. Stalls: waiting on the TMA barriers
(long scoreboard) 33 % of samples, issuing 24 %, shared-memory loads 14 %. Dense, with 1,280
splits, runs at 4.15 TB/s. Shorter splits do not help (`min_splits` 2-4 at 4K and 8K: from 4 %
faster to 6 % slower; at 1K x 64, 2,048 one-tile programs instead of 1,024 two-tile ones cost
12.7 us, about 3 us a wave of 264 programs), nor do more stages (three: within 5 %; four halve
the programs an SM), so the per-split start (list copy, then the first tiles) is not hidden at
two programs an SM. Mosaic GPU sets no register bound (no launch bounds, no `maxnreg`) and ptxas
takes 213-233 registers whatever the code's live values; three programs an SM need <= 168.
A persistent, warp-specialised kernel (commit fe28cd8, `MosaicConfig(streams=N)`, removed after;
benchmarks/results/h200-2026-12-02/warp-specialised/): one CTA an SM, in it N pairs of a memory
warpgroup (copies each split's share of the list one split ahead, its q and its tiles' K/V into
the pair's ring) and a compute warpgroup (this kernel's per-tile arithmetic; both prefetch the
next split's row metadata). With N = 2 the memory warpgroups give up registers (`setmaxnreg`) and
the second pair runs inside a dummy SMEM allocation: Mosaic GPU puts a cross-warp reduction's
scratch at the SMEM offset in use where it is lowered, the same for every warpgroup, so two
computing warpgroups would otherwise reduce through the same bytes. Its gpu tests passed on an
H200 (N = 1 also in the interpreter; N = 2 did not finish in jax 0.10.2's interpreter on a 2-core
CPU). No faster: dense within 1 % of the grid kernel; sparse 30.0 / 38.6 / 37.6 us with N = 2
against 31.1 / 37.0 / 35.6, and more, shorter splits cost as much as here (1K x 64 sparse at
`min_splits=2`: +14 us), so issuing the copies is not what bounds sparse. Sparse reads run at about
3 TB/s against dense's 4.3 in either kernel (4K x 20), and not for the blocks' scatter: on the
same share of contiguous blocks this kernel saves 0.7-1.1 us (sparse-contiguous/ there: 30.1 /
36.2 / 34.6 us against 31.2 / 36.9 / 35.5). The list and finish launches then took about 5 us a call.

What ran fastest (h200-2026-12-03/reuse/kernels/, one run, us per call): plain calls
`MosaicConfig()` (64-key tiles, 1024 keys a split, two stages, the reductions, the list in the
kernel, the grid split-major), dense 129.9 / 160.9 / 161.0 at 1K x 64 / 4K x 20 / 8K x 10 (0.908 /
0.922 / 0.911x the Triton kernel, 1.044 / 0.924 / 1.022x cuDNN SDPA), discover 0.889 / 0.902 /
0.894x and discover+sparse 0.867 / 0.899 / 0.907x Triton; sparse as reuse calls (`launch_config`:
mma products, rows=4 at 1K x 64, 2048-key splits at 4K and 8K; one launch, splits merged in the
split kernel) 24.4 / 28.8 / 27.4 (0.841 / 0.874 / 0.864x Triton, 0.788 / 0.933 / 1.054x cuDNN
SDPA on a contiguous 13 %), the same launch with the finish launch 26.8 / 31.5 / 29.8. Before
the reuse calls and the grid order (h200-2026-12-03/mma/kernels/): sparse 26.9 / 32.8 / 30.9 (1.188x
cuDNN at 8K x 10). Earlier, with the reductions only:
benchmarks/results/h200-2026-12-02/list-loads/ (this module before
`MosaicConfig.rows`; device time per call, 16 heads x 128, bf16, 1K x 64 / 4K x 20 / 8K x 10): dense 129.7 /
159.9 / 160.7 us (0.909 / 0.915 / 0.909x the Triton kernel, 1.044 / 0.917 / 1.023x cuDNN SDPA),
sparse at 13 % 29.8 / 33.3 / 33.4 us (1.032 / 1.010 / 1.058x Triton, 0.966 / 1.079 / 1.290x
cuDNN SDPA on a contiguous 13 %); the same code in split-sweep/: dense 127.7 / 157.4 / 157.9,
sparse 29.9 / 33.3 / 32.9 (1.036 / 1.014 / 1.048x Triton); with rows (rows/, rows=1): dense
127.7 / 157.6 / 158.2, sparse 29.8 / 33.8 / 33.5, whose programs past every row's list then
still set up the attend step (they end after q's copy again since). The current code with the
hinted launch in sparse (rows-choice/kernels/): dense 131.2 / 161.8 / 162.1 us (0.918 / 0.926 /
0.917x Triton, 1.035 / 0.913 / 1.029x cuDNN SDPA; 129.6 / 159.6 / 160.0 in the same session's
bench_pallas run, rows-choice/ouro-shapes/), sparse 27.8 (rows 4) / 34.1 / 33.4 (0.960 / 1.034 /
1.058x Triton, 0.904 / 1.090 / 1.287x cuDNN on a contiguous 13 %).
The split kernel is most of the call
(sparse 27.3 / 30.6 / 29.5 us, the finish 2.2-2.9). Against FlashAttention-4
(paged; h200-2026-12-01/kernels-fa4/, the list as a launch then): dense 0.97 / 0.94 / 0.76x. At
8K x 10, 2048-key splits gave sparse 31.2-31.5 us then (one split a row, not 32 + 1 blocks) but
dense 164-165 us, so the default keeps 1024.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, nvvm, vector

from wise_core import modes as wise_modes
from wise_jax.decode_check import check_call
from wise_jax.kernels import pallas_decode

LOG2E = math.log2(math.e)
LIST_CHUNK = 32  # list entries copied to shared memory at least (a TMA moves 128-byte multiples)
LIST_ALIGN = 4  # int32 entries in 16 bytes: a TMA copy's global address must be 16-byte aligned
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 16-bit, 128-byte rows
ROW = plgpu.Layout.WGMMA.reduce(1)  # [keys]: one value per key slot of a tile
COL = plgpu.Layout.WGMMA.reduce(0)  # [head_dim]
DOT_ROWS = 64  # q padded to this many rows for wgmma (its smallest M)
WARPGROUP = 128  # threads of a program
SCALAR = plgpu.Layout.WG_SPLAT(shape=())  # a scalar passed to inline Mosaic GPU code
PRODUCTS = ("mma", "reduce", "wgmma")  # MosaicConfig.products


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch shape: keys per step (tile_n, a multiple of 64: the WGMMA layout's rows), keys
    per program (split_keys) and min_splits (as pallas_decode.KernelConfig), num_stages (tiles
    in flight per program), products (how a tile's q.K and p.V run: "reduce", layout-hinted
    reductions in f32; "mma", tensor-core mma.sync a warp in raw Mosaic GPU code, `_scores_mma` /
    `_pv_mma`, the reductions when interpreted: the interpreter does not run raw Mosaic GPU code;
    "wgmma", wgmma with q in row 0 of a 64-row tile, slower on an H200 and run on a GPU only;
    `launch_config` picks "mma" for reuse calls).
    list_launch: the block list as a launch of its own (`pallas_decode._list_kernel`), always so
    when interpreted; else each program lists its split's blocks itself (`_list_in_kernel`).
    rows: heads a program attends (1, 2 or 4: consecutive heads of one sequence, split s of
    each, their tiles through one ring), for calls of many short rows (not with wgmma)."""

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
        if self.rows > 1 and self.products == "wgmma":
            raise ValueError("MosaicConfig.rows > 1 does not run with products='wgmma'")
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


PROGRAMS_PER_SM = 2  # split-kernel programs an H200 SM holds (head_dim 128: registers, above);
# launch_config takes it for every head_dim (a wrong count costs speed, not results)
SPARSE_SPLIT_KEYS = 2048  # keys a split in a reuse call's launch whose rows need several


def launch_config(batch: int, heads: int, max_blocks: int, *, block_size: int,
                  reuse: bool, n_sm: int | None) -> MosaicConfig:
    """The launch of a call given no config: MosaicConfig(), changed for a reuse call (WISE's
    reuse loops: rows SPARSE, a few DENSE) when n_sm is known (not interpreted):
    - products "mma": tensor cores for the tile's products, which shorten the chain of each
      split (H200, 2026-12-03, h200-2026-12-03/mma/: sparse at 13 % 25.5 / 32.5 / 31.9 us against
      28.8 / 33.2 / 32.9 with the reductions at 1K x 64 / 4K x 20 / 8K x 10) but cost dense calls
      1-2.5 % (131.3 / 159.6 / 159.9 against 128.1 / 158.2 / 158.1 us), so plain calls keep them.
    - rows past one split (context over split_keys): SPARSE_SPLIT_KEYS keys a split. The grid
      has a program for every split a row could need (a DENSE row's), and every program lists
      its row before it knows whether its split exists, so a sparse call's many empty programs
      cost time; a DENSE row in such a call runs fewer, longer splits (H200, 2026-12-03,
      h200-2026-12-03/grid-order/split-major/, the grid split-major: sparse at 13 % 30.4 / 28.8
      us against 30.4 / 30.4 with 1024-key splits at 4K x 20 / 8K x 10; with 4096-key splits
      29.7 / 28.5, but a DENSE row would then run up to 64 tiles in one program).
    - rows of one split: heads grouped (`rows`) where the programs' waves favour it: counting
      a program's time as its rows', waves of the batch * heads / rows programs over the GPU's
      n_sm * PROGRAMS_PER_SM slots times rows is least (ties to more rows). Outputs do not
      depend on rows (bitwise).

    H200 (2026-12-02, the reductions, sparse at 13 %, 16 heads, us per call, rows 1 / 2 / 4;
    benchmarks/results/h200-2026-12-02/rows-choice/): 1K x 32 14.6 / 13.1 / 17.4 (picks 2), 1K x
    48 22.1 / 24.0 / 24.3 (picks 1), 1K x 64 29.1 / - / 26.8 (picks 4; rows 2 29.5 in rows/), 1K x
    128 50.2 / 49.7 / 48.8 (picks 4); at 2K x 64, 4K x 20 / 64 and 8K x 10 / 32, where rows are
    not one split, rows 1 is fastest."""
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
    """Whether this kernel takes q/K/V of this head_dim and dtype (16-bit, head_dim % 64 == 0)."""
    return head_dim % 64 == 0 and jnp.dtype(dtype).name in ("bfloat16", "float16")


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
    [head_dim] f32, out_smem [head_dim]; extra: with wgmma (rows == 1), q_tile [DOT_ROWS,
    head_dim] (tiled, swizzled): q in row 0, zeros elsewhere; with merge, the barrier of the
    merge's copies.
    reuse: a reuse loop's call (rows SPARSE or DENSE): a discovery row's output is NaN (outside
    the contract). merge: the last split of a row to arrive merges the row's splits (`_merge`).
    """
    q_tile = extra[0] if products == "wgmma" else None
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
        if products == "wgmma":
            row = rows[0]
            store(row, *_attend_dots(
                q_smem.at[0], q_tile, k_smem, v_smem, k_bar, v_bar, stat_m_ref, stat_l_ref,
                fetch, b=b, h=row["h"], lo=row["lo"], hi=row["hi"], n_tiles=n_tiles,
                n_listed=row["n_listed"], tail_keys=row["tail_keys"], discovering=discovering,
                block_size=block_size, tile_blocks=tile_blocks, num_stages=num_stages,
                scale=scale))
            return

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
                scores = _scores_mma(k, q) * scale
            else:
                scores = jnp.sum(k.astype(jnp.float32) * q, axis=1)
            scores = jnp.where(ok, scores, -jnp.inf)
            plgpu.barrier_wait(v_bar.at[slot])
            if products == "mma":  # V's fragments for the tensor cores (a container: _load_vt)
                v = _load_vt(v_smem.at[slot])
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
                acc = _pv_mma(p, acc * alpha, v)
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

        b, p, s, mode, seq_len = map(_scalar, (b, p, s, mode, seq_len))
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
            up = _shfl_up(scan, c(d), c(-1), c(0))
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
        # pallas_decode._split_size (a test holds the two lists bitwise equal)
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


def _scalar(x):
    """A SCALAR (splat) argument of inline Mosaic GPU code as an i32 value."""
    x = x.registers.item()
    return arith.index_cast(ir.IntegerType.get_signless(32), x) if isinstance(x.type, ir.IndexType) else x


def _shfl_up(value, distance, mask, clamp):
    """nvvm.shfl_sync in up mode (jaxlib 0.10 and 0.11 name its parameters differently)."""
    if next(iter(inspect.signature(nvvm.shfl_sync).parameters)) == "thread_mask":
        return nvvm.shfl_sync(mask, value, distance, clamp, nvvm.ShflKind.up, results=[value.type])
    return nvvm.shfl_sync(value.type, mask, value, distance, clamp, nvvm.ShflKind.up)


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


def _scores_mma(k, q):
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


def _load_vt(v_slot):
    """V's B fragments for `_pv_mma` from one ring slot (SMEM [tile_n, head_dim], 16-bit, TILED):
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


def _pv_mma(p, acc, v):
    """acc [tile_n, head_dim] f32 (WGMMA) + p [tile_n] f32 (ROW) . V, V's fragments from
    `_load_vt` (v): each warp gathers its 16 slots' p as row 0 of A (shuffles; rounded to V's
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


def _shfl_idx(value, lane):
    """value of another lane of the warp (an f32 through shfl.sync.idx)."""
    i32 = ir.IntegerType.get_signless(32)
    out = llvm.inline_asm(i32, [mgpu_utils.bitcast(value, i32), lane],
                          "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r",
                          has_side_effects=True)
    return mgpu_utils.bitcast(out, value.type)


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
    """After a split of a row of n_splits stored its partials: count it in (`_arrive`); the last
    split to arrive merges the row's splits as pallas_decode's finish does (weights exp2(m_j -
    max m), out = sum_j w_j acc_j / sum_j w_j l_j, summed split after split: the same result
    within f32 rounding, not bitwise), each acc_j copied through acc_smem."""
    plgpu.wait_smem_to_gmem(0)  # this split's acc written, not only read
    last = _arrive(arrivals, slot_smem, b=b, h=h) == n_splits - 1

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


def _arrive(arrivals, slot_smem, *, b, h):
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

        b, h = _scalar(b), _scalar(h)
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


def _attend_dots(q_smem, q_tile, k_smem, v_smem, k_bar, v_bar, stat_m_ref, stat_l_ref, fetch, *,
                 b, h, lo, hi, n_tiles, n_listed, tail_keys, discovering, block_size,
                 tile_blocks, num_stages, scale):
    """The split's tiles with q.K and p.V as wgmma (`MosaicConfig.dots`): q in row 0 of a
    [DOT_ROWS, head_dim] tile, the other rows zero (each row runs its own online softmax; only
    row 0's is kept). Returns row 0's (max, sum, acc [head_dim])."""
    wgmma_layout = plgpu.Layout.WGMMA
    tile_n, head_dim = k_smem.shape[1], k_smem.shape[2]
    rows = plgpu.broadcasted_iota(jnp.int32, (DOT_ROWS, head_dim), 0, layout=wgmma_layout)
    q = lax.broadcast_in_dim(plgpu.layout_cast(q_smem[...], COL), (DOT_ROWS, head_dim), [1])
    q_tile[...] = jnp.where(rows == 0, q, jnp.zeros_like(q))
    plgpu.commit_smem()
    key_slot = plgpu.broadcasted_iota(jnp.int32, (DOT_ROWS, tile_n), 1, layout=wgmma_layout)
    key_block = key_slot // block_size
    row0 = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (DOT_ROWS,), 0), ROW) == 0

    def first_row(x):  # x [DOT_ROWS] (ROW) -> x[0], exactly (the other rows add zeros)
        return jnp.sum(jnp.where(row0, x, 0.0))

    def step(t, carry):
        m, l, acc = carry  # [DOT_ROWS], [DOT_ROWS], [DOT_ROWS, head_dim]: per q row
        slot = lax.rem(t, num_stages)
        plgpu.barrier_wait(k_bar.at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_tile, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
            return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((DOT_ROWS, tile_n), jnp.float32))
        ok = _valid_keys(lo + t * tile_blocks, key_slot, hi=hi, n_listed=n_listed,
                         tail_keys=tail_keys, block_size=block_size)
        scores = jnp.where(ok, scores * scale, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=1))
        m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_base)
        p = jnp.exp2(scores - lax.broadcast_in_dim(m_base, scores.shape, [0]))

        pl.when(discovering)(functools.partial(  # row 0's
            _store_block_stats, stat_m_ref, stat_l_ref, b=b, h=h, first=lo + t * tile_blocks,
            hi=hi, tile_blocks=tile_blocks, block_m=lambda: first_row(m_base),
            block_l=lambda j: first_row(jnp.sum(jnp.where(key_block == j, p, 0.0), axis=1))))

        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p16 = p.astype(v_smem.dtype)
        plgpu.barrier_wait(v_bar.at[slot])

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        # Refill the slot once both products have read it (run_state waits for the wgmma).
        pl.when(t + num_stages < n_tiles)(functools.partial(fetch, t + num_stages, slot))
        return m_new, l * alpha + p.sum(axis=1), acc

    init = (plgpu.layout_cast(jnp.full((DOT_ROWS,), -jnp.inf, jnp.float32), ROW),
            plgpu.layout_cast(jnp.zeros((DOT_ROWS,), jnp.float32), ROW),
            plgpu.layout_cast(jnp.zeros((DOT_ROWS, head_dim), jnp.float32), wgmma_layout))
    m, l, acc = lax.fori_loop(0, n_tiles, step, init)
    return first_row(m), first_row(l), jnp.sum(jnp.where(rows == 0, acc, 0.0), axis=0)


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
    if products == "wgmma":
        scratch.append(plgpu.SMEM((DOT_ROWS, head_dim), q.dtype, transforms=TILED))
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
            seq_lens, modes, support, partials, out_dtype=q.dtype, block_size=block_size,
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
    if config.products == "wgmma" and interpret:
        raise ValueError("MosaicConfig(products='wgmma') needs a GPU: jax's GPU interpreter does not run "
                         "wgmma on a transposed or register operand")
    return tuple(_decode(
        q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size,
        eta=float(eta), scale=float(scale), all_blocks=bool(all_blocks),
        return_mass=bool(return_mass), config=config, reuse=bool(reuse),
        interpret=interpret_params() if interpret else None))
