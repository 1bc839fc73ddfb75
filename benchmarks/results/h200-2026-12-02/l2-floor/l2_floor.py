"""The Mosaic kernel's call time with K/V from HBM (pages scattered over the pool, as
bench_pallas.py) against K/V from L2 (every page-table entry 0: the same blocks for every row),
with two and three stages. Run from the repository root on a GPU:

    python benchmarks/results/h200-2026-12-02/l2-floor/l2_floor.py
"""
import sys
sys.path[:0] = ["benchmarks", "."]
import jax, jax.numpy as jnp
import bench_pallas as bp
from wise_core import modes as M
from wise_jax.kernels import mosaic_decode as md

for ctx, batch in ((4096, 20), (8192, 10), (1024, 64)):
    q, k, v, pt, sl = bp._cache(jax.random.key(ctx + batch), ctx, batch, 16, 128, 128, jnp.bfloat16)
    sup = bp._support(batch, 16, ctx // 32, 0.13)
    for mode in ("sparse", "dense"):
        modes = jnp.full((batch,), M.SPARSE if mode == "sparse" else M.DENSE, jnp.int32)
        for stages in (2, 3):
            cfg = md.MosaicConfig(num_stages=stages)
            def step(q, k, v, pt, sl, modes, support, cfg=cfg):
                return md.decode_attention(q, k, v, pt, sl, modes, support, block_size=32, eta=0.95,
                                           config=cfg, validate=False)[0]
            chains = bp._chains(step, (2, 16))
            for label, table in (("hbm", pt), ("l2", jnp.zeros_like(pt))):
                us = bp._time_us(chains, (q, k, v, table, sl, modes, bp._per_call(sup, (2, 16))), repeats=3)
                print(f"{ctx}x{batch} {mode} stages={stages} {label}: {us:.1f} us", flush=True)
