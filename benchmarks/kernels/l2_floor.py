"""What bounds the Mosaic GPU decode-attention call: K/V from HBM against K/V from L2.

    python -m benchmarks.kernels.l2_floor                       # on an H200 (sm90)

Times `wise_jax.kernels.mosaic_decode.decode_attention` (`MosaicConfig(num_stages=S)`, S in
--stages) with the K/V pages scattered over the pool as in every kernel benchmark ("hbm") and with
every page-table entry 0 ("l2": every row reads the same blocks, which stay in L2): same rows,
same block lists, same arithmetic. Sparse rows at --density, and dense rows; 16 heads x 128,
bf16, pages of 128 keys. A call's time is `bench_pallas.time_us`'s (on a GPU the profiler's device
span of a chain of 16 calls, the median of --repeats). Prints one line per (shape, mode, stages,
source).
"""

from __future__ import annotations

import argparse

from benchmarks.engine.workload import parse_shapes

HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_SIZE = 16, 128, 128, 32
CHAIN = (2, 16)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("4096x20,8192x10,1024x64"),
                   help="CONTEXTxBATCH list: keys per row x rows")
    p.add_argument("--stages", default="2,3", help="comma-separated MosaicConfig.num_stages values")
    p.add_argument("--density", type=float, default=0.13, help="blocks a sparse row attends")
    p.add_argument("--repeats", type=int, default=3)
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp

    from benchmarks.kernels import bench_pallas
    from wise_core import modes
    from wise_jax.kernels import mosaic_decode

    results = []
    for context, batch in args.shapes:
        q, k, v, page_table, seq_lens = bench_pallas.decode_inputs(jax.random.key(context + batch), context, batch,
                                                                   HEADS, HEAD_DIM, PAGE_SIZE, jnp.bfloat16)
        support = bench_pallas.support_of(batch, HEADS, context // BLOCK_SIZE, args.density)
        for mode in ("sparse", "dense"):
            row_modes = jnp.full((batch,), modes.SPARSE if mode == "sparse" else modes.DENSE, jnp.int32)
            for stages in map(int, args.stages.split(",")):
                config = mosaic_decode.MosaicConfig(num_stages=stages)

                def step(q, k, v, page_table, seq_lens, row_modes, support, config=config):
                    return mosaic_decode.decode_attention(q, k, v, page_table, seq_lens, row_modes, support,
                                                          block_size=BLOCK_SIZE, eta=0.95, config=config,
                                                          validate=False)[0]

                chains = bench_pallas.chains_of(step, CHAIN)
                for source, table in (("hbm", page_table), ("l2", jnp.zeros_like(page_table))):
                    us = bench_pallas.time_us(chains, (q, k, v, table, seq_lens, row_modes,
                                                       bench_pallas.per_call(support, CHAIN)), repeats=args.repeats)
                    print(f"{context}x{batch} {mode} stages={stages} {source}: {us:.1f} us", flush=True)
                    results.append(dict(context=context, batch=batch, mode=mode, stages=stages, source=source, us=us))
    return results


if __name__ == "__main__":
    main()
