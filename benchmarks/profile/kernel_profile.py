"""Where a Pallas decode-attention call's time goes: each kernel of the call under the profiler.

    python -m benchmarks.profile.kernel_profile --out DIR                          # on a GPU: Ouro shapes
    python -m benchmarks.profile.kernel_profile --out DIR --impls mosaic --modes sparse --shapes 4096x20
    python -m benchmarks.profile.kernel_profile --out DIR --smoke                  # CPU, interpreters
    python -m benchmarks.profile.kernel_profile --out DIR --impls mosaic --mosaic-config min_splits=2

Per (shape, impl, mode) one jitted chain of --calls calls (`benchmarks.kernels.bench_pallas`'s setup: 16 heads x
head_dim 128, bf16, pages of 128 scattered over the pool, sparse at --density) runs once to
compile, then once under `jax.profiler` (perfetto trace); each call has its own copy of the
support, so no call's list is hoisted out of the chain. Reported per call: device time per
kernel name (the list fusions, the split kernel, the finish), busy (summed kernel time) and
span (first kernel's start to last kernel's end over the chain, divided by the calls), so
span - busy is the device's idle time between kernels. Writes kernel_profile.json and .md.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
from pathlib import Path

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.kernels import bench_pallas as bp  # noqa: E402
from benchmarks import report as rp  # noqa: E402
from wise_jax.kernels import mosaic_decode, pallas_decode  # noqa: E402

MODES = ("dense", "discover", "sparse", "discover+sparse")


def _us(x) -> str:
    """A time in us, or "n/a" where the trace had no device kernels (a CPU run)."""
    return "n/a" if x is None else f"{x:.1f}"


def profile_case(impl, mode, ctx, batch, *, density, calls, heads, head_dim, page_size, dtype,
                 interpret, mosaic_config=None) -> dict:
    """`device_trace.device_activity` of one chain of `calls` calls of impl in mode, per call
    (mosaic_config: the Mosaic kernel's launch, default MosaicConfig())."""
    decode = {"pallas": pallas_decode, "mosaic": mosaic_decode}[impl].decode_attention
    launch = dict(config=mosaic_config) if impl == "mosaic" and mosaic_config else {}
    q, k, v, page_table, seq_lens = bp.decode_inputs(jax.random.key(ctx + batch), ctx, batch, heads,
                                              head_dim, page_size, dtype)
    n_blocks = ctx // bp.BLOCK
    cases = {name: (d, row_modes, sd) for name, d, row_modes, sd in bp.pallas_cases((density,), batch)}
    _, row_modes, support_density = cases[mode]
    support = bp.support_of(batch, heads, n_blocks, support_density)
    modes = jnp.asarray(row_modes, jnp.int32)

    def step(q, k, v, page_table, seq_lens, modes, support):
        return decode(q, k, v, page_table, seq_lens, modes, support, block_size=bp.BLOCK,
                      eta=0.95, interpret=interpret, validate=False, **launch)[0]

    (_, chain), = bp.chains_of(step, (calls,))
    args = (q, k, v, page_table, seq_lens, modes, bp.per_call(support, (calls,)))
    chain(*args).block_until_ready()  # compile and warm up
    return bp.chain_activity(chain, args, calls)


def markdown(report: dict) -> str:
    out = [f"# Pallas decode-attention call profile ({report['date']})", "",
           f"{report['environment']['device']}; jax {report['environment']['jax']}; {report['calls']} chained "
           f"calls per case, sparse density {report['density']}; times in us per call; mosaic: "
           f"`{report['mosaic_config']}`.", "",
           "| ctx x batch | impl | mode | busy | span | kernels (us per call) |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            out.append(f"| {r['ctx']} x {r['batch']} | {r['impl']} | {r['mode']} | | "
                       f"| `{r['error'][:200]}` |")
            continue
        kernels = ", ".join(f"`{name[:40]}` {v['us_per_step']:.1f}" + (f" (x{v['calls_per_step']:.0f})"
                                                                        if v["calls_per_step"] != 1 else "")
                            for name, v in list(r["kernels"].items())[:8])
        out.append(f"| {r['ctx']} x {r['batch']} | {r['impl']} | {r['mode']} | {_us(r['busy_us'])} "
                   f"| {_us(r['span_us'])} | {kernels} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default=",".join(f"{c}x{b}" for c, b in bp.OURO_SHAPES))
    p.add_argument("--impls", default="pallas,mosaic")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--density", type=float, default=bp.SWEEP_DENSITY)
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--mosaic-config", type=bp.mosaic_config_arg, default=None,
                   help="the Mosaic kernel's MosaicConfig as NAME=VALUE,... (default MosaicConfig())")
    p.add_argument("--smoke", action="store_true", help="one tiny shape in the interpreters (CPU)")
    args = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    common = dict(heads=16, head_dim=128, page_size=128, dtype=jnp.bfloat16, interpret=False)
    if args.smoke:
        shapes, common = [(128, 2)], dict(heads=2, head_dim=64, page_size=32, dtype=jnp.bfloat16,
                                          interpret=True)
    elif jax.default_backend() != "gpu":
        raise SystemExit("kernel_profile needs a GPU (use --smoke for a CPU check of the code paths)")
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {MODES}")
    report = dict(date=rp.now(), environment=rp.environment("jax"), calls=args.calls,
                  density=args.density, rows=[],
                  mosaic_config=repr(args.mosaic_config or mosaic_decode.MosaicConfig()))
    for ctx, batch in shapes:
        for impl in args.impls.split(","):
            for mode in modes:
                row = dict(ctx=ctx, batch=batch, impl=impl, mode=mode)
                try:
                    row.update(profile_case(impl, mode, ctx, batch, density=args.density,
                                            calls=args.calls, mosaic_config=args.mosaic_config,
                                            **common))
                    print(f"{ctx} x {batch} {impl} {mode}: busy {_us(row['busy_us'])} us, "
                          f"span {_us(row['span_us'])} us per call", flush=True)
                except Exception as e:  # a failed case must not stop the run
                    row["error"] = f"{type(e).__name__}: {e}"[:800]
                    print(f"{ctx} x {batch} {impl} {mode}: {row['error']}", flush=True)
                report["rows"].append(row)
                rp.write_json(args.out / "kernel_profile.json", report)  # a run cut short keeps its rows
    print(rp.write_report(args.out, "kernel_profile", report, markdown(report)), end="")
    return report


if __name__ == "__main__":
    main()
