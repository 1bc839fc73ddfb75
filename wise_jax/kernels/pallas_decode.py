"""Paged split-KV decode attention with per-row WISE modes, as Pallas kernels.

One call serves a batch whose rows may each be DENSE, DISCOVER, DISCOVER_UNION or SPARSE
(`wise_core.modes`), in one kernel launch and no other device work (besides zeroing a
counter):

1. Split phase, grid (batch, heads, splits). A row's block list is every causal block
   (DENSE, DISCOVER, DISCOVER_UNION) or the causal blocks of its support (SPARSE), ascending,
   numbered by a prefix sum over the row's bits in registers. Split `s` walks its contiguous
   share of the list, `tile_blocks` blocks per step: the pos-th listed block is found by
   counting, its `block_size` keys are gathered from its page, and an online softmax
   accumulates them. The loop never branches on the mode. It writes the unnormalised partial
   output, its running max and sum, and the log-sum-exp of every block it visited.
2. Finish, per (row, head), run by the last split to arrive (an atomic counter; or, with
   `KernelConfig.fused_finish=False`, by a second launch): merges the splits by log-sum-exp,
   writes the output, the block mass `exp(lse_block - max) / sum` of discovery rows (zeros
   for other rows), and support': the selection for discovery rows (OR-ed into the held
   support for DISCOVER_UNION), the held support otherwise.

Bitwise by construction: DISCOVER and DISCOVER_UNION run exactly the DENSE path (the mass
is a by-product), and a SPARSE row whose support holds every causal block gets the same list,
hence the same split boundaries and accumulation order, as DENSE.

NaN and empty rows. NaN in q, k or v reaches the output (and the mass) as NaN, and a
discovery row keeps causal blocks only, whatever its mass. A SPARSE head that selects no
causal block (outside the contract: `validate` rejects it) outputs 0 / 0 = NaN, as every
implementation does.

Selection. Pallas has no sort on GPU, so the finish ranks blocks by pairwise
comparison (mass descending, ties to the lower index) in [64 x 32] tiles: block i is kept iff
nothing ranks ahead of it, or its mass is positive and the mass ranked ahead of it is below
`eta * total`. That is `wise_core.reference.select_blocks` summed in another order: the two
agree except where a running sum lies within float32 rounding of the threshold (the spec
allows this). The O(max_blocks^2) ranking runs only for discovery rows (`pl.when`).

Backend. Every mode runs through the Pallas Triton lowering (`_compiler_params`, the one
place that picks it), deprecated in jax 0.11 but supported there, and the one path that can be
checked on a CPU machine: the tests run the kernels with `interpret=True`, lower them for CUDA
to Triton IR and compile that IR for sm90 with the Triton compiler. Mosaic GPU is not used
for any mode: decode is a matrix-vector product per (row, head) (Ouro is MHA: one query row
per KV head), below the 64-row minimum of wgmma, so the Hopper fast path does not apply; the
paged, per-row compacted gathers need per-block async copies with data-dependent addresses;
and a Mosaic GPU kernel cannot be compiled or lowered without a GPU, so none could be
verified before its first run. The backend is also one choice for all
modes by necessity: one launch serves every mode of a mixed batch, and a SPARSE row with every
block selected must be bitwise DENSE, which two backends' arithmetic would not give.

GQA: each program serves one query head (supports are per query head), reading its KV head.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from wise_core import modes as wise_modes
from wise_jax.attention import check_call

_SELECT_ROWS = 64  # ranking tile of the selection: [rows, cols] block pairs per step
_SELECT_COLS = 32


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters (tile_blocks, num_splits and num_warps are powers of two).

    tile_blocks: blocks gathered per loop step; num_splits: splits of each row's block list;
    num_warps, num_stages: Triton launch parameters; fused_finish: the last split of each
    (row, head) to arrive (an atomic counter) merges and selects, instead of a second launch.
    """

    tile_blocks: int = 2
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    fused_finish: bool = True

    def __post_init__(self) -> None:
        for name in ("tile_blocks", "num_splits", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise ValueError(
                    f"KernelConfig.{name} must be a positive power of two, got {value!r}")
        if not isinstance(self.num_stages, int) or self.num_stages <= 0:
            raise ValueError(
                f"KernelConfig.num_stages must be a positive integer, got {self.num_stages!r}")


def default_config(batch: int, heads: int, max_blocks: int, head_dim: int, block_size: int,
                   num_cores: int | None = None) -> KernelConfig:
    """Heuristic launch: ~64 x head_dim keys per step, enough splits for ~8 programs per core."""
    if num_cores is None:
        num_cores = getattr(jax.devices()[0], "core_count", None) or 132
    tile_blocks = max(1, 8192 // (block_size * head_dim))
    steps = -(-max_blocks // tile_blocks)
    splits = 1
    while batch * heads * splits < 8 * num_cores and steps // (2 * splits) >= 4:
        splits *= 2
    return KernelConfig(tile_blocks=tile_blocks, num_splits=splits)


def _compiler_params(num_warps: int, num_stages: int):
    """The GPU backend of every kernel and mode: the Pallas Triton lowering (module docstring)."""
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# Kernels


def _listed_blocks(support_ref, b, h, seq_len, mode, *, block_size, blocks_pad):
    """bool[blocks_pad]: the causal blocks row b attends (SPARSE: its support; else all)."""
    index = jnp.arange(blocks_pad, dtype=jnp.int32)
    held = pl_triton.load(support_ref.at[b, h, index], mask=index < support_ref.shape[-1],
                          other=False)
    return (held | (mode != wise_modes.SPARSE)) & (index * block_size < seq_len)


def _split_kernel(seq_lens_ref, modes_ref, support_ref, page_table_ref, q_ref, k_ref, v_ref,
                  *refs, block_size, page_size, tile_blocks, num_splits, scale, finish, barrier):
    """One (row, head, split): online softmax over this split's share of the row's block list.

    page_table_ref: [max_pages]; q_ref: [head_dim]; k_ref, v_ref: [num_pages * page_size,
    head_dim] (this head's KV head); other refs whole: support [batch, heads, max_blocks],
    partials acc [batch, heads, splits, head_dim], m and l [batch, heads, splits], block_lse
    [batch, heads, blocks_pad] (by list position). With `finish` (a dict of _finish's static
    arguments, or None), refs also hold the finish outputs and a zeroed counter
    int32[batch, heads]: the last split of each (row, head) to arrive runs _finish. barrier:
    synchronise the program's threads before the counter (off in the interpreter, which runs
    programs one at a time).
    """
    if finish is None:
        acc_ref, m_ref, l_ref, block_lse_ref = refs
    else:  # the counter's input ref, then outputs; the counter's output ref aliases the input
        (_, acc_ref, m_ref, l_ref, block_lse_ref, out_ref, support_out_ref, mass_ref,
         counter_ref) = refs
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len, mode = seq_lens_ref[b], modes_ref[b]
    n_blocks, blocks_pad = support_ref.shape[-1], block_lse_ref.shape[-1]
    listed = _listed_blocks(support_ref, b, h, seq_len, mode, block_size=block_size,
                            blocks_pad=blocks_pad).astype(jnp.int32)
    rank = jnp.cumsum(listed)  # listed blocks up to and including each block
    n_listed = jnp.sum(listed)
    n_steps = (n_listed + tile_blocks - 1) // tile_blocks
    per_split = (n_steps + num_splits - 1) // num_splits
    start = s * per_split
    stop = jnp.minimum(start + per_split, n_steps)
    q = q_ref[...].astype(jnp.float32) * scale
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    dims = jnp.arange(q.shape[0], dtype=jnp.int32)[None, None, :]

    def step(t, carry):
        m, l, acc = carry
        pos = t * tile_blocks + jnp.arange(tile_blocks, dtype=jnp.int32)  # list positions
        in_list = pos < n_listed
        # The pos-th listed block is the number of blocks listed at most pos times before it.
        block = jnp.sum((rank[None, :] <= pos[:, None]).astype(jnp.int32), axis=1)
        first = jnp.minimum(block, n_blocks - 1) * block_size  # first key: [tile_blocks]
        pages = page_table_ref[first // page_size]
        rows = (pages * page_size + first % page_size)[:, None] + offsets[None, :]
        valid = in_list[:, None] & (first[:, None] + offsets[None, :] < seq_len)
        gather = (rows[:, :, None], dims)  # [tile_blocks, block_size, head_dim]
        k = pl_triton.load(k_ref.at[gather], mask=valid[:, :, None], other=0)
        v = pl_triton.load(v_ref.at[gather], mask=valid[:, :, None], other=0)  # both in flight
        scores = jnp.sum(k.astype(jnp.float32) * q[None, None, :], axis=-1)
        scores = jnp.where(valid, scores, -jnp.inf)  # [tile_blocks, block_size]
        m_new = jnp.maximum(m, jnp.max(scores))
        p = jnp.exp(scores - m_new)
        block_sum = jnp.sum(p, axis=1)
        correction = jnp.exp(m - m_new)
        pv = jnp.sum(jnp.sum(p[:, :, None] * v.astype(jnp.float32), axis=1), axis=0)
        pl_triton.store(block_lse_ref.at[b, h, pos], m_new + jnp.log(block_sum), mask=in_list)
        return m_new, l * correction + jnp.sum(block_sum), acc * correction + pv

    init = (jnp.float32(-jnp.inf), jnp.float32(0), jnp.zeros(q.shape, jnp.float32))
    m, l, acc = jax.lax.fori_loop(start, stop, step, init)
    acc_ref[b, h, s, :] = acc
    m_ref[b, h, s] = m
    l_ref[b, h, s] = l
    if finish is None:
        return
    if barrier:  # every thread's partial stores precede the counter's release
        pl_triton.debug_barrier()
    arrived = pl_triton.atomic_add(counter_ref, (b, h), jnp.ones((), jnp.int32))  # acq_rel, GPU

    @pl.when(arrived == num_splits - 1)
    def _last_split_finishes():
        _finish(b, h, seq_lens_ref, modes_ref, support_ref, acc_ref, m_ref, l_ref, block_lse_ref,
                out_ref, support_out_ref, mass_ref, block_size=block_size, volatile=True, **finish)


def _finish_kernel(*refs, block_size, eta, all_blocks):
    """One (row, head) of _finish, as its own launch (refs as _finish's)."""
    _finish(pl.program_id(0), pl.program_id(1), *refs, block_size=block_size, eta=eta,
            all_blocks=all_blocks, volatile=False)


def _finish(b, h, seq_lens_ref, modes_ref, support_ref, acc_ref, m_ref, l_ref, block_lse_ref,
            out_ref, support_out_ref, mass_ref, *, block_size, eta, all_blocks, volatile):
    """Row b, head h: merge the splits by log-sum-exp; mass and selection of discovery rows.

    Whole refs: support, support_out, mass [batch, heads, max_blocks]; acc [batch, heads,
    splits, head_dim]; m, l [batch, heads, splits]; block_lse [batch, heads, blocks_pad];
    out [batch, heads, head_dim]. volatile: read the partials from L2, past the L1 cache
    (other programs wrote them in this launch).
    """
    def load(ref_view):
        return pl_triton.load(ref_view, volatile=volatile)

    mode = modes_ref[b]
    discovering = (mode == wise_modes.DISCOVER) | (mode == wise_modes.DISCOVER_UNION)
    n_causal = (seq_lens_ref[b] + block_size - 1) // block_size  # a discovery row's list
    n_blocks, blocks_pad = support_ref.shape[-1], block_lse_ref.shape[-1]
    m = load(m_ref.at[b, h, :])
    m_max = jnp.max(m)
    weight = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - m_max))
    total = jnp.sum(weight * load(l_ref.at[b, h, :]))
    acc = jnp.sum(weight[:, None] * load(acc_ref.at[b, h, :, :]), axis=0)
    out_ref[b, h, :] = (acc / total).astype(out_ref.dtype)  # NaN stays NaN; no keys: 0 / 0

    def block_mass(first, size):  # [size]: mass of blocks [first, first + size) (0 if none)
        index = first + jnp.arange(size, dtype=jnp.int32)
        lse = load(block_lse_ref.at[b, h, pl.ds(first, size)])
        return jnp.where(discovering & (index < n_causal), jnp.exp(lse - m_max) / total, 0.0)

    index = jnp.arange(blocks_pad, dtype=jnp.int32)
    pl_triton.store(mass_ref.at[b, h, index], block_mass(0, blocks_pad), mask=index < n_blocks)

    @pl.when(jnp.logical_not(discovering))
    def _keep_support():
        held = pl_triton.load(support_ref.at[b, h, index], mask=index < n_blocks, other=False)
        pl_triton.store(support_out_ref.at[b, h, index], held, mask=index < n_blocks)

    @pl.when(discovering)
    def _select():
        threshold = eta * jnp.sum(block_mass(0, blocks_pad))
        rows, cols = min(_SELECT_ROWS, blocks_pad), min(_SELECT_COLS, blocks_pad)

        def rank_tile(i0):  # keep[rows] for blocks [i0, i0 + rows), by pairwise ranking
            mi = block_mass(i0, rows)[:, None]
            ii = (i0 + jnp.arange(rows, dtype=jnp.int32))[:, None]

            def col_tile(tj, sums):
                before, ahead_count = sums
                j0 = tj * cols
                mj = block_mass(j0, cols)[None, :]
                jj = (j0 + jnp.arange(cols, dtype=jnp.int32))[None, :]
                ahead = (mj > mi) | ((mj == mi) & (jj < ii))
                return (before + jnp.sum(jnp.where(ahead, mj, 0.0), axis=1),
                        ahead_count + jnp.sum(ahead.astype(jnp.int32), axis=1))

            before, ahead_count = jax.lax.fori_loop(
                0, blocks_pad // cols, col_tile,
                (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.int32)))
            return (ahead_count == 0) | ((mi[:, 0] > 0) & (before < threshold))

        def row_tile(ti, carry):
            i0 = ti * rows
            ii = i0 + jnp.arange(rows, dtype=jnp.int32)
            keep = ii < n_causal if all_blocks else rank_tile(i0) & (ii < n_causal)  # NaN mass too
            held = pl_triton.load(support_ref.at[b, h, ii], mask=ii < n_blocks, other=False)
            keep = keep | (held & (mode == wise_modes.DISCOVER_UNION))
            pl_triton.store(support_out_ref.at[b, h, ii], keep, mask=ii < n_blocks)
            return carry

        jax.lax.fori_loop(0, blocks_pad // rows, row_tile, 0)


# ---------------------------------------------------------------------------------------------
# Launchers


def _finish_shapes(batch, heads, head_dim, n_blocks, out_dtype):
    return [jax.ShapeDtypeStruct((batch, heads, head_dim), out_dtype),
            jax.ShapeDtypeStruct((batch, heads, n_blocks), jnp.bool_),
            jax.ShapeDtypeStruct((batch, heads, n_blocks), jnp.float32)]


def _split_call(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size, scale,
                blocks_pad, config: KernelConfig, finish, interpret: bool):
    """The split kernel; with `finish` (dict of eta, all_blocks) it also finishes (fused)."""
    batch, heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    splits = config.num_splits
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
    f32 = jnp.float32
    out_shape = [jax.ShapeDtypeStruct((batch, heads, splits, head_dim), f32),  # acc
                 jax.ShapeDtypeStruct((batch, heads, splits), f32),  # m
                 jax.ShapeDtypeStruct((batch, heads, splits), f32),  # l
                 jax.ShapeDtypeStruct((batch, heads, blocks_pad), f32)]  # block lse
    aliases = {}
    if finish is not None:
        out_shape += _finish_shapes(batch, heads, head_dim, support.shape[-1], q.dtype)
        out_shape.append(jax.ShapeDtypeStruct((batch, heads), jnp.int32))  # counter
        in_specs.append(whole)
        args.append(jnp.zeros((batch, heads), jnp.int32))
        aliases = {len(args) - 1: len(out_shape) - 1}
    kernel = functools.partial(
        _split_kernel, block_size=block_size, page_size=page_size,
        tile_blocks=config.tile_blocks, num_splits=splits, scale=scale, finish=finish,
        barrier=not interpret)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, splits),
        in_specs=in_specs,
        out_specs=[whole] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="wise_decode_split",
    )(*args)


def _finish_call(seq_lens, modes, support, acc, m, l, block_lse, *, out_dtype, block_size, eta,
                 all_blocks, interpret: bool):
    batch, heads, _, head_dim = acc.shape
    kernel = functools.partial(_finish_kernel, block_size=block_size, eta=eta,
                               all_blocks=all_blocks)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads),
        in_specs=[pl.BlockSpec()] * 7,
        out_specs=[pl.BlockSpec()] * 3,
        out_shape=_finish_shapes(batch, heads, head_dim, support.shape[-1], out_dtype),
        compiler_params=_compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="wise_decode_finish",
    )(seq_lens, modes, support, acc, m, l, block_lse)


@functools.partial(jax.jit, static_argnames=("block_size", "eta", "scale", "all_blocks",
                                             "config", "interpret"))
def _decode(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size, eta, scale,
            all_blocks, config, interpret):
    blocks_pad = max(_next_pow2(support.shape[-1]), config.tile_blocks)
    finish = dict(eta=eta, all_blocks=all_blocks)
    outputs = _split_call(q, k_pages, v_pages, page_table, seq_lens, modes, support,
                          block_size=block_size, scale=scale, blocks_pad=blocks_pad,
                          config=config, finish=finish if config.fused_finish else None,
                          interpret=interpret)
    if config.fused_finish:
        return tuple(outputs[4:7])
    return tuple(_finish_call(seq_lens, modes, support, *outputs, out_dtype=q.dtype,
                              block_size=block_size, interpret=interpret, **finish))


# ---------------------------------------------------------------------------------------------
# Public API


def decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size,
                     eta, scale=None, return_mass=False, interpret=None, all_blocks=False,
                     config: KernelConfig | None = None, validate: bool = True):
    """Decode attention over a paged KV cache with per-row WISE modes (docs/DESIGN.md).

    q: [batch, heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim];
    page_table: int32[batch, max_pages]; seq_lens: int32[batch] (keys in the cache, >= 1);
    modes: int32[batch] (`wise_core.modes`); support: bool[batch, heads, max_blocks] with
    max_blocks = max_pages * page_size // block_size.
    Returns (out [batch, heads, head_dim] in q's dtype, support' bool[batch, heads, max_blocks])
    and, with return_mass, mass float32[batch, heads, max_blocks] (zeros for rows that do not
    discover). all_blocks: discovery rows select every causal block. interpret: run the
    kernels in the Pallas interpreter (default: when the default backend is not a GPU).
    config: launch parameters (default: `default_config` for these shapes). validate: also
    check the values (`wise_jax.attention.check_call`; under jit a host callback per call).
    NaN in q, k or v gives NaN outputs; a SPARSE head that selects no causal block (outside
    the contract) gives NaN outputs when not validated.
    """
    seq_lens = check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support,
                          block_size=block_size, eta=eta, validate=validate)
    _check_kernel_inputs(q, k_pages)
    batch, heads, head_dim = q.shape
    if scale is None:
        scale = head_dim ** -0.5
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if config is None:
        config = default_config(batch, heads, support.shape[-1], head_dim, block_size)
    out, new_support, mass = _decode(
        q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size,
        eta=float(eta), scale=float(scale), all_blocks=bool(all_blocks), config=config,
        interpret=bool(interpret))
    return (out, new_support, mass) if return_mass else (out, new_support)


def _check_kernel_inputs(q, k_pages):
    """What this kernel needs beyond the shared contract: a power-of-two head_dim."""
    head_dim = q.shape[-1]
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two for the Pallas kernel, got {head_dim}")
