"""One jitted Mosaic GPU decode-attention call, run a few times: the target for Nsight Compute
and for Mosaic GPU's dumps (`benchmarks.kernels.bench_pallas`'s setup: pages of 128 scattered over the pool,
sparse at --density of each row's blocks per head).

    ncu -k regex:mosaic --launch-skip 1 --launch-count 1 --section Occupancy \\
        python -m benchmarks.kernels.mosaic_call --shape 4096x20 --mode sparse
    MOSAIC_GPU_DUMP_TO=DIR python -m benchmarks.kernels.mosaic_call --shape 4096x20 --calls 1  # PTX, ptxas, SASS
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.kernels import bench_pallas as bp
from wise_core import modes as M
from wise_jax.kernels import mosaic_decode

MODES = {"dense": M.DENSE, "discover": M.DISCOVER, "sparse": M.SPARSE}


def main(argv=None) -> jax.Array:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4096x20", help="CTXxBATCH")
    p.add_argument("--mode", choices=sorted(MODES), default="sparse")
    p.add_argument("--density", type=float, default=bp.SWEEP_DENSITY)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--config", type=bp.mosaic_config_arg, default=mosaic_decode.MosaicConfig(),
                   help="MosaicConfig fields as NAME=VALUE,... (default MosaicConfig())")
    args = p.parse_args(argv)
    try:
        ctx, batch = (int(x) for x in args.shape.split("x"))
    except ValueError:
        p.error(f"--shape takes CTXxBATCH, e.g. 4096x20, got {args.shape!r}")
    if args.calls < 1:
        p.error(f"--calls must be at least 1, got {args.calls}")
    q, k, v, page_table, seq_lens = bp.decode_inputs(jax.random.key(ctx + batch), ctx, batch, args.heads,
                                              args.head_dim, args.page_size, jnp.bfloat16)
    n_blocks = ctx // bp.BLOCK
    support = bp.support_of(batch, args.heads, n_blocks, args.density if args.mode == "sparse" else None)
    modes = jnp.full((batch,), MODES[args.mode], jnp.int32)
    call = jax.jit(lambda *a: mosaic_decode.decode_attention(
        *a, block_size=bp.BLOCK, eta=0.95, config=args.config, validate=False)[0])
    for _ in range(args.calls):
        out = call(q, k, v, page_table, seq_lens, modes, support)
    out.block_until_ready()
    print(f"{args.calls} calls, {args.mode} at {ctx} x {batch}: out {out.shape} {out.dtype}")
    return out


if __name__ == "__main__":
    main()
