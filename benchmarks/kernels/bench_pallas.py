"""Timing of the Pallas WISE decode kernels, and of jax's Pallas paged attention, per mode.

    python -m benchmarks.kernels.bench_pallas --out DIR            # on a GPU: Ouro-1.4B attention shapes
    python -m benchmarks.kernels.bench_pallas --out DIR --sweep    # also other launch configurations
    python -m benchmarks.kernels.bench_pallas --out DIR --smoke    # CPU, interpreters, tiny shapes
    python -m benchmarks.kernels.bench_pallas --out DIR --impls mosaic --mosaic-config split_keys=2048,min_splits=2

`bench_pallas(shapes, densities)` returns rows keyed impl, mode, ctx, batch, density, us, tbps
(plus config, and error where a case failed); `benchmarks/kernels/kernel_bench.py` merges them with the
Triton kernel's rows of the same run. Shapes are (ctx, batch) at 16 heads x head_dim 128,
bf16, pages of 128 keys scattered over the pool, every row at seq_len = ctx.

- impl "pallas" (wise_jax.kernels.pallas_decode, the Triton lowering, its table's launch) and
  impl "mosaic" (wise_jax.kernels.mosaic_decode, the split kernel on Mosaic GPU, MosaicConfig();
  its sparse modes are reuse calls, as WISE's reuse loops make them: `launch_config`'s launch,
  the splits merged in the split kernel): modes dense, discover, sparse (random blocks,
  `density` of each row's blocks per head), sparse-contiguous (the first blocks, the same for
  every head, as kernel_bench.py's Triton rows), discover+sparse (half the rows each) and, for
  mosaic, sparse-plain (sparse's launch in a plain call: the finish launch merges); with
  --sweep, impls "pallas-config" and
  "mosaic-config": dense and sparse under other launches, most promising first, until
  --sweep-seconds is spent (--mosaic-config: those MosaicConfigs instead of the Mosaic sweep's);
- impl "jax-paged" (jax.experimental.pallas.ops.gpu.paged_attention, the best of the tile
  settings `JAX_PAGED_SETTINGS` that fit): mode dense, and mode contiguous: lengths of 13%
  of ctx, the floor a sparse kernel at that density can hope for (--no-jax-paged skips it).
Time per call (`time_us`): jitted chains of calls, each call's output the next call's query and
each call its own copy of the support (lengths for jax-paged), so no call's work is hoisted or
shared; on a GPU the profiler's device span of the longest chain over its length (kernels back
to back, as CUDA-graph replay times the torch kernels; the median of `repeats` runs), in the
interpreters the difference of two chains' wall times. tbps counts the K and V bytes attended.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import argparse
import dataclasses
import math
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report as rp
from benchmarks.profile.device_trace import device_activity
from wise_core import modes as M
from wise_jax.kernels import mosaic_decode, pallas_decode
from wise_jax.kernels.mosaic_decode import MosaicConfig
from wise_jax.kernels.pallas_decode import KernelConfig, config_for

OURO_SHAPES = ((1024, 64), (4096, 20), (8192, 10))  # (ctx, batch)
DENSITIES = (0.05, 0.13, 0.25, 0.5)
CONTIGUOUS = 0.13
SWEEP_DENSITY = 0.13
BLOCK = 32
JAX_PAGED_SETTINGS = ((4, 2), (8, 1), (8, 2), (16, 1))  # (k_splits, pages_per_compute_block)


def chains_of(step, chain):
    """Jitted chains of `step(q, *rest, x) -> q'` of the lengths in `chain`, called as
    run(q, *rest, xs): call i takes xs[i] (distinct buffers of one value), so XLA can neither
    hoist a call's work on x out of the chain nor share it between calls -- a decode step's
    calls differ."""
    def chained(n):
        @jax.jit
        def run(q, *rest):
            *rest, xs = rest
            for i in range(n):
                q = step(q, *rest, xs[i])
            return q
        return run
    return [(n, chained(n)) for n in chain]


def per_call(x, chain):
    """max(chain) distinct copies of x, the last argument of `chains_of`'s runs."""
    return tuple(jnp.copy(x) for _ in range(max(chain)))


def chain_activity(run, args, calls) -> dict:
    """`device_trace.device_activity` of one run of a chain of `calls` calls under the
    profiler, per call."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            run(*args).block_until_ready()
        return device_activity(Path(trace_dir), calls)


def time_us(chains, args, *, repeats):
    """Per-call microseconds. On a GPU: the device span (first kernel's start to last kernel's
    end, from the profiler) of one run of the longest chain over its length -- kernels back to
    back, as CUDA-graph replay times a torch kernel -- the median of `repeats` runs. Elsewhere
    (the interpreters): the difference of the chains' median wall times over the difference
    of their lengths."""
    if jax.default_backend() == "gpu":
        n, run = max(chains, key=lambda c: c[0])
        run(*args).block_until_ready()  # compile and warm up (the other chains are not compiled)
        return float(np.median([chain_activity(run, args, n)["span_us"] for _ in range(repeats)]))
    medians = []
    for _, run in chains:
        run(*args).block_until_ready()  # compile and warm up
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(*args).block_until_ready()
            samples.append(time.perf_counter() - start)
        medians.append(float(np.median(samples)))
    (short, _), (long, _) = chains
    return (medians[1] - medians[0]) / (long - short) * 1e6


def decode_inputs(key, ctx, batch, heads, head_dim, page_size, dtype):
    """q, k_pages, v_pages, page_table (a shuffled pool), seq_lens (all ctx)."""
    if ctx % page_size:
        raise ValueError(f"ctx {ctx} is not a multiple of the page size {page_size}")
    pages = ctx // page_size
    kq, kk, kv, kp = jax.random.split(key, 4)
    shape = (batch * pages, page_size, heads, head_dim)
    q = jax.random.normal(kq, (batch, heads, head_dim), dtype)
    k = jax.random.normal(kk, shape, dtype)
    v = jax.random.normal(kv, shape, dtype)
    page_table = jax.random.permutation(kp, batch * pages).reshape(batch, pages).astype(jnp.int32)
    return q, k, v, page_table, jnp.full((batch,), ctx, jnp.int32)


def support_of(batch, heads, n_blocks, density, contiguous=False):
    """bool[batch, heads, n_blocks]: every block (density None), else max(1, round(density *
    n_blocks)) blocks per head: random ones (the same in every run), or with contiguous the
    first ones."""
    if density is None:
        return jnp.ones((batch, heads, n_blocks), bool)
    keep = max(1, round(density * n_blocks))
    if contiguous:
        return jnp.broadcast_to(jnp.arange(n_blocks) < keep, (batch, heads, n_blocks))
    uniform = jax.random.uniform(jax.random.key(7), (batch, heads, n_blocks))
    return jnp.argsort(jnp.argsort(uniform, -1), -1) < keep


def _row(impl, mode, ctx, batch, density, us, kv_bytes, config, error=None):
    row = dict(impl=impl, mode=mode, ctx=ctx, batch=batch, density=density, us=us,
               tbps=kv_bytes / (us * 1e6) if us == us and us > 0 else float("nan"),
               config=config)
    if error is not None:
        row["error"] = error
    return row


def _attempt(rows, describe, measure):
    """Add measure()'s rows; on failure, one row with us = nan and the error (never raise).

    describe: (impl, mode, ctx, batch, density, config) of the failure row."""
    try:
        rows.extend(measure())
    except Exception as e:  # a failed case must not stop the run
        traceback.print_exc()
        *head, config = describe
        rows.append(_row(*head, us=float("nan"), kv_bytes=0, config=config,
                         error=f"{type(e).__name__}: {e}"[:500]))


def pallas_cases(densities, batch):
    """(mode name, density, per-row modes, support density or None)."""
    half = np.arange(batch) < batch // 2
    cases = [("dense", 1.0, np.full(batch, M.DENSE), None),
             ("discover", 1.0, np.full(batch, M.DISCOVER), None)]
    for d in densities:
        cases.append(("sparse", d, np.full(batch, M.SPARSE), d))
        cases.append(("sparse-contiguous", d, np.full(batch, M.SPARSE), d))
        cases.append(("discover+sparse", d, np.where(half, M.DISCOVER, M.SPARSE), d))
    return cases


def _bench_kernel_shape(rows, impl, ctx, batch, densities, *, heads, head_dim, page_size, dtype,
                        interpret, chain, repeats, configs, sweep_seconds=math.inf):
    """Rows of one kernel (impl "pallas" or "mosaic") at one shape: every mode under
    configs[0], dense and sparse under the others while the sweep's time lasts."""
    decode = {"pallas": pallas_decode, "mosaic": mosaic_decode}[impl].decode_attention
    q, k, v, page_table, seq_lens = decode_inputs(jax.random.key(ctx + batch), ctx, batch, heads,
                                           head_dim, page_size, dtype)
    n_blocks = ctx // BLOCK
    block_bytes = 2 * BLOCK * head_dim * jnp.dtype(dtype).itemsize  # K and V of one block, one head
    sweep_start = time.perf_counter()
    for index, config in enumerate(configs):
        if index and time.perf_counter() - sweep_start > sweep_seconds:
            print(f"{impl} {ctx} x {batch}: sweep budget spent, {len(configs) - index} "
                  f"configurations not tried", flush=True)
            break
        if index == 1:
            sweep_start = time.perf_counter()

        def compiled(config, reuse):  # chains of one launch, compiled once, run for every mode
            if (config, reuse) not in chains:
                def step(q, k, v, page_table, seq_lens, modes, support):
                    return decode(q, k, v, page_table, seq_lens, modes, support, block_size=BLOCK,
                                  eta=0.95, interpret=interpret, config=config, validate=False,
                                  reuse=reuse)[0]
                chains[config, reuse] = chains_of(step, chain)
            return chains[config, reuse]

        chains = {}
        name = impl if index == 0 else f"{impl}-config"
        cases = pallas_cases(densities, batch)
        if impl == "mosaic":
            cases += [("sparse-plain", *case[1:]) for case in cases if case[0] == "sparse"]
        for mode, density, row_modes, support_density in cases:
            if index and (mode, density) not in (("dense", 1.0), ("sparse", SWEEP_DENSITY)):
                continue  # other launch configurations: dense and sparse @0.13 only
            launch, reuse = config, impl == "mosaic" and mode in ("sparse", "sparse-contiguous")
            if impl == "mosaic" and index == 0 and mode.startswith("sparse"):
                # the launch of a reuse call (WISE's reuse loops)
                launch = mosaic_decode.launch_config(
                    batch, heads, n_blocks, block_size=BLOCK, reuse=True,
                    n_sm=mosaic_decode.sm_count(interpret))
            support = support_of(batch, heads, n_blocks, support_density,
                               contiguous=mode == "sparse-contiguous")
            attended = np.where(row_modes == M.SPARSE, np.asarray(support.sum((1, 2))),
                                heads * n_blocks)
            modes = jnp.asarray(row_modes, jnp.int32)

            def measure(modes=modes, support=support, attended=attended, mode=mode, density=density,
                        launch=launch, reuse=reuse):
                us = time_us(compiled(launch, reuse), (q, k, v, page_table, seq_lens, modes,
                                                        per_call(support, chain)), repeats=repeats)
                return [_row(name, mode, ctx, batch, density, us,
                             float(attended.sum()) * block_bytes, str(launch))]

            _attempt(rows, (name, mode, ctx, batch, density, str(launch)), measure)


def _bench_jax_paged_shape(ctx, batch, *, heads, head_dim, page_size, dtype, interpret, chain,
                           repeats):
    """Rows of jax's paged attention, dense and contiguous, each the best setting that runs."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    q, k, v, page_table, _ = decode_inputs(jax.random.key(ctx + batch), ctx, batch, heads, head_dim,
                                    page_size, dtype)
    k_heads_first, v_heads_first = k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3)
    pages = ctx // page_size
    settings = {(s, min(p, pages // s)) for s, p in JAX_PAGED_SETTINGS if pages % s == 0}
    key_bytes = 2 * head_dim * jnp.dtype(dtype).itemsize * heads  # K and V of one position
    chains = {}
    for k_splits, per_block in settings:
        def step(q, k, v, page_table, lengths, k_splits=k_splits, per_block=per_block):
            return paged_attention(q, k, v, page_table, lengths, k_splits=k_splits,
                                   pages_per_compute_block=per_block, interpret=interpret)
        chains[k_splits, per_block] = chains_of(step, chain)  # compiled once, run for both modes
    rows = []
    for mode, density in (("dense", 1.0), ("contiguous", CONTIGUOUS)):
        lengths = jnp.full((batch,), max(1, round(density * ctx)), jnp.int32)
        best, errors = None, []
        for k_splits, per_block in sorted(settings):
            setting = f"k_splits={k_splits},pages_per_compute_block={per_block}"
            try:
                us = time_us(chains[k_splits, per_block],
                              (q, k_heads_first, v_heads_first, page_table, per_call(lengths, chain)),
                              repeats=repeats)
            except Exception as e:  # a setting that does not run is skipped
                errors.append(f"{setting}: {type(e).__name__}: {e}"[:300])
                continue
            if best is None or us < best[0]:
                best = (us, setting)
        if best is None:
            rows.append(_row("jax-paged", mode, ctx, batch, density, float("nan"), 0, "",
                             error="; ".join(errors) or "no setting fits"))
        else:
            rows.append(_row("jax-paged", mode, ctx, batch, density, best[0],
                             float(int(lengths[0]) * batch * key_bytes), best[1]))
    return rows


def sweep_configs(head_dim, dtype):
    """The table's launch first, then alternatives, most promising first (the sweep stops at
    its time budget): the Triton kernel's sweep in this kernel's terms (keys per step and per
    program, warps, stages, dots or reductions, min_splits, the fused finish)."""
    base = config_for(head_dim, dtype)
    C = KernelConfig
    alternatives = [
        dataclasses.replace(base, fused_finish=not base.fused_finish),
        C(tile_n=64, split_keys=512, num_stages=3, dots=True, min_splits=4),
        C(tile_n=64, split_keys=512, num_stages=2),
        C(tile_n=64, split_keys=512, num_stages=2, min_splits=4),
        C(tile_n=64, split_keys=256, num_stages=3, dots=True),
        C(tile_n=64, split_keys=1024, num_stages=3, dots=True),
        C(tile_n=64, split_keys=512, num_stages=2, dots=True),
        C(tile_n=64, split_keys=512, num_stages=4, dots=True),
        C(tile_n=128, split_keys=1024, num_stages=3, dots=True),
        C(tile_n=128, split_keys=1024, num_warps=8, num_stages=3, dots=True),
        C(tile_n=64, split_keys=512, num_warps=8, num_stages=2),
        C(tile_n=128, split_keys=1024, num_warps=8, num_stages=2),
        C(tile_n=32, split_keys=256, num_stages=3, dots=True),
    ]
    return [base] + [c for c in dict.fromkeys(alternatives) if c != base]


def mosaic_sweep_configs():
    """MosaicConfig() first, then alternatives (shared memory per program: 2 x num_stages x
    tile_n x head_dim x 2 bytes, at most ~200 KB on an H200 for head_dim 128)."""
    base = MosaicConfig()
    C = MosaicConfig
    # Ordered by the H200 sweeps of 2026-12-01 (docs/kernels/mosaic_decode.md): closest to the
    # default first, the mma products (launch_config's for sparse) and the clearly slower shapes last.
    alternatives = [C(split_keys=2048), C(min_splits=2), C(min_splits=3),
                    C(split_keys=1024, num_stages=3), C(split_keys=512), C(split_keys=512, num_stages=3),
                    C(split_keys=2048, num_stages=3), C(products="mma"),
                    C(min_splits=4), C(split_keys=256, num_stages=3), C(num_stages=4),
                    C(tile_n=128, split_keys=1024)]
    return [base] + [c for c in dict.fromkeys(alternatives) if c != base]


def parse_mosaic_config(text: str) -> MosaicConfig:
    """A MosaicConfig from NAME=VALUE items ("split_keys=2048,products=reduce"; ints, True/False,
    else the text)."""
    fields = {f.name for f in dataclasses.fields(MosaicConfig)}
    kwargs = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"a MosaicConfig takes NAME=VALUE items with NAME in {sorted(fields)}, "
                             f"got {item!r}")
        if value in ("True", "False"):
            kwargs[name] = value == "True"
        elif value.lstrip("-").isdigit():
            kwargs[name] = int(value)
        else:
            kwargs[name] = value
    return MosaicConfig(**kwargs)


def mosaic_config_arg(text: str) -> MosaicConfig:
    """parse_mosaic_config for argparse (its message, not argparse's generic one)."""
    try:
        return parse_mosaic_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def bench_pallas(shapes=OURO_SHAPES, densities=DENSITIES, *, heads=16, head_dim=128,
                 page_size=128, dtype=jnp.bfloat16, interpret=None, chain=(4, 16), repeats=3,
                 impls=("pallas", "mosaic"), sweep=False, sweep_seconds=math.inf,
                 jax_paged=True, mosaic_configs=()) -> list[dict]:
    """Rows keyed impl, mode, ctx, batch, density, us, tbps, config (and error if it failed).

    shapes: iterable of (ctx, batch); densities: support densities of the sparse modes; impls:
    the WISE kernels timed ("pallas", "mosaic"; mosaic only where it takes head_dim and
    dtype); sweep_seconds: per kernel and shape; mosaic_configs: MosaicConfigs timed after
    MosaicConfig() (dense and sparse), in place of the Mosaic sweep's, each whatever
    sweep_seconds says.
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    rows: list[dict] = []
    for ctx, batch in shapes:
        common = dict(heads=heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
                      interpret=interpret, chain=chain, repeats=repeats)
        for impl in impls:
            budget = sweep_seconds
            if impl == "mosaic":
                if not mosaic_decode.supports(head_dim, dtype):
                    continue
                configs = ([MosaicConfig(), *mosaic_configs] if mosaic_configs else
                           mosaic_sweep_configs() if sweep else [MosaicConfig()])
                if mosaic_configs:  # asked for by name, not a sweep: every one is timed
                    budget = math.inf
            else:
                configs = sweep_configs(head_dim, dtype) if sweep else [config_for(head_dim, dtype)]
            _bench_kernel_shape(rows, impl, ctx, batch, densities, configs=configs,
                                sweep_seconds=budget, **common)
        if jax_paged:
            _attempt(rows, ("jax-paged", "dense", ctx, batch, 1.0, ""),
                     lambda: _bench_jax_paged_shape(ctx, batch, **common))
    return rows


def _table(rows) -> str:
    lines = ["| impl | mode | ctx x batch | density | us | TB/s | config |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['mode']} | {r['ctx']} x {r['batch']} | {r['density']:.2f} "
                     f"| {r['us']:.1f} | {r['tbps']:.2f} | {r.get('error') or r['config']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON and table")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in interpret mode (checks the code paths on a CPU)")
    parser.add_argument("--sweep", action="store_true", help="also time other launch configurations")
    parser.add_argument("--sweep-seconds", type=float, default=math.inf,
                        help="time budget of the sweep per kernel and shape")
    parser.add_argument("--impls", default="pallas,mosaic", help="WISE kernels to time (pallas, mosaic)")
    parser.add_argument("--shapes", default=",".join(f"{c}x{b}" for c, b in OURO_SHAPES),
                        help="CTXxBATCH,... (default the Ouro shapes)")
    parser.add_argument("--densities", default=",".join(map(str, DENSITIES)),
                        help="support densities of the sparse modes")
    parser.add_argument("--no-jax-paged", action="store_true", help="skip jax's paged attention")
    parser.add_argument("--mosaic-config", action="append", default=[], type=mosaic_config_arg,
                        help="a MosaicConfig to time after the default, as NAME=VALUE,... (repeatable)")
    args = parser.parse_args(argv)
    impls = tuple(args.impls.split(","))
    if args.smoke:
        rows = bench_pallas(((128, 2),), (0.5,), heads=2, head_dim=64, page_size=32,
                            interpret=True, chain=(1, 2), repeats=1, impls=impls, sweep=args.sweep,
                            sweep_seconds=args.sweep_seconds, jax_paged=not args.no_jax_paged,
                            mosaic_configs=args.mosaic_config)
    else:
        if jax.default_backend() != "gpu":
            raise SystemExit("bench_pallas needs a GPU (use --smoke for a CPU check of the code paths)")
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        rows = bench_pallas(shapes, tuple(float(d) for d in args.densities.split(",")),
                            impls=impls, sweep=args.sweep, sweep_seconds=args.sweep_seconds,
                            jax_paged=not args.no_jax_paged, mosaic_configs=args.mosaic_config)
    report = dict(date=rp.now(), environment=rp.environment("jax"), smoke=args.smoke, rows=rows)
    print(rp.write_report(args.out, "bench_pallas", report, _table(rows) + "\n"), end="")


if __name__ == "__main__":
    main()
