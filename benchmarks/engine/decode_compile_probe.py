"""Compile time and step time of the JAX dense decode step: unrolled against a scan over the loops.

    python -m benchmarks.engine.decode_compile_probe --shapes 1024x16,1024x1             # on a GPU
    python -m benchmarks.engine.decode_compile_probe --preset test-tiny --dtype float32 --shapes 64x2   # CPU

Variants: "unrolled" is `wise_jax.model.decode_step(scan_loops=False)` (every loop x every
unstacked layer, straight-line code); "loopscan" is a `lax.scan` over all the loops with the
layers unrolled in its body and the K/V plane index traced (the weights are the same every loop,
so nothing is copied per loop). The engine's step scans each run of loops of one role
(`model.decode_step`'s default, `scan_loops=True`), which for dense decode is "loopscan"'s shape. Both dense, the decode attention `resolve_kernel("auto")` picks,
random weights with q_proj x --q-scale, a donated cache of exactly the cohort's pages. Compile =
`jit(...).lower(...).compile()`; step = wall time of one call with `block_until_ready` (dispatch
included), the median of steps 3-12 and the minimum. Prints one JSON object per (shape,
variant) after compiling and again after stepping, with the compiled program's memory analysis
(temporaries, aliased bytes), the ops that touch the K/V pool and a checksum of the logits (the
variants must agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path

from benchmarks.engine.workload import parse_shapes

VARIANTS = ("loopscan", "unrolled")
TIMED_STEPS = 12
UNTIMED_STEPS = 2   # the median leaves out the first steps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="ouro-1.4b", help="model shape (wise_core PRESETS)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1024x16,1024x1"),
                   help="CONTEXTxBATCH list: keys in the cache x rows")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    p.add_argument("--q-scale", type=float, default=8.0, help="q_proj multiplier of the random weights")
    p.add_argument("--dump", type=Path, help="folder to write each compiled program's HLO text to")
    return p


def probe(args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    import wise_jax
    from wise_core import modes
    from wise_core.presets import PRESETS
    from wise_core.wise_config import WiseConfig
    from wise_jax import kv_cache, model
    from wise_jax.attention import decode_attention, resolve_kernel
    from wise_jax.params import scale_queries, unstack_layers

    config = PRESETS[args.preset]
    dtype = jnp.dtype(args.dtype)
    params = unstack_layers(scale_queries(config, wise_jax.init_params(config, jax.random.PRNGKey(0), dtype=dtype),
                                          args.q_scale))
    kernel = resolve_kernel("auto", config.head_dim)
    layers = config.num_hidden_layers
    dense = WiseConfig()

    def loopscan_step(params, cache, tokens, tags, width):
        batch = tokens.shape[0]
        positions = cache.seq_lens
        active = tags >= 0
        cache, fits = kv_cache.try_reserve(cache, jnp.where(active, positions + 1, positions), width)
        live = active & fits
        seq_lens = jnp.where(live, cache.seq_lens, 1)
        h = model.embed(params, tokens)[:, None]
        cos, sin = model.rope(positions[:, None], config.head_dim, config.rope_theta)
        row_modes = jnp.full((batch,), modes.DENSE, jnp.int32)
        support = jnp.zeros((batch, config.num_attention_heads, width * cache.page_size // dense.block_size), bool)

        def one_loop(carry, loop):
            h, cache = carry

            def attend(q, k, v, layer, cache):
                plane = loop * layers + layer
                cache = kv_cache.write_token(cache, plane, k[:, 0], v[:, 0], live)
                k_pages, v_pages, table = kv_cache.plane_pages(cache, plane, width)
                out, _ = decode_attention(q[:, 0], k_pages, v_pages, table, seq_lens, row_modes, support,
                                          block_size=dense.block_size, eta=dense.eta, kernel=kernel, validate=False)
                return out[:, None], cache

            # run_loop ends with the final norm; the next loop starts from it, as decode_step does
            h, cache = model.run_loop(params, config, h, cos, sin, attend, cache)
            return (h, cache), None

        (h, cache), _ = lax.scan(one_loop, (h, cache), jnp.arange(config.total_ut_steps, dtype=jnp.int32))
        return model.head(params, h[:, 0]), cache

    def unrolled_step(params, cache, tokens, tags, width):
        logits, cache, _ = model.decode_step(params, config, cache, None, tokens, tags, wise_config=None,
                                             kernel=kernel, width=width, scan_loops=False)
        return logits, cache

    def full_cache(batch: int, context: int, page_size: int = 128):
        """A cache whose rows hold `context` keys each in pages of their own, with room for the step."""
        pages = -(-(context + 64) // page_size)
        cache = kv_cache.create(config, batch=batch, max_pages=pages, num_pages=batch * pages + 1,
                                page_size=page_size, dtype=dtype)
        table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
        free = np.zeros(batch * pages + 1, np.int32)
        free[0] = batch * pages
        return dataclasses.replace(cache, page_table=jnp.asarray(table), seq_lens=jnp.full((batch,), context, jnp.int32),
                                   free_pages=jnp.asarray(free), num_free=jnp.asarray(1, jnp.int32)), pages

    steps = dict(loopscan=loopscan_step, unrolled=unrolled_step)
    results = []
    for context, batch in args.shapes:
        for name in args.variants.split(","):
            cache, width = full_cache(batch, context)
            jitted = jax.jit(steps[name], static_argnames=("width",), donate_argnums=(1,))
            tokens = tags = jnp.arange(batch, dtype=jnp.int32)
            start = time.perf_counter()
            lowered = jitted.lower(params, cache, tokens, tags, width=width)
            lowered_at = time.perf_counter()
            compiled = lowered.compile()
            compiled_at = time.perf_counter()
            memory = compiled.memory_analysis()
            hlo = compiled.as_text()
            if args.dump:
                (args.dump / f"{name}_{context}x{batch}.hlo.txt").write_text(hlo)
            pool = "[%s]" % ",".join(map(str, cache.k.shape))
            flat = "[%s]" % ",".join(map(str, (cache.k.shape[0] * cache.k.shape[1],) + cache.k.shape[2:]))
            pool_lines = [line for line in hlo.splitlines() if pool in line or flat in line]
            pool_ops = {m.group(1) for line in pool_lines for m in [re.search(r"= .*?[ ]([a-z][a-z0-9-]*)[(]", line)] if m}
            result = dict(variant=name, batch=batch, ctx=context, trace_lower_s=round(lowered_at - start, 2),
                          compile_s=round(compiled_at - lowered_at, 2), pool_gib=round(2 * cache.k.nbytes / 2**30, 2),
                          temp_gib=round(memory.temp_size_in_bytes / 2**30, 3),
                          alias_gib=round(memory.alias_size_in_bytes / 2**30, 3), pool_ops=sorted(pool_ops))
            print(json.dumps(result), flush=True)
            try:
                out, cache = compiled(params, cache, tokens, tags)
                out.block_until_ready()
                times = []
                for _ in range(TIMED_STEPS):   # every step decodes at the same context
                    cache = dataclasses.replace(cache, seq_lens=jnp.full((batch,), context, jnp.int32),
                                                num_free=jnp.asarray(1, jnp.int32))
                    start = time.perf_counter()
                    out, cache = compiled(params, cache, tokens, tags)
                    out.block_until_ready()
                    times.append(time.perf_counter() - start)
                result.update(step_ms_median=round(1e3 * float(np.median(times[UNTIMED_STEPS:])), 3),
                              step_ms_min=round(1e3 * min(times), 3), kernel=kernel,
                              checksum=float(jnp.abs(out.astype(jnp.float32)).sum()))
            except Exception as e:   # reported in the result; the other variants go on
                result.update(error=str(e)[:300])
            print(json.dumps(result), flush=True)
            results.append(result)
            del cache, compiled, lowered
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    return probe(args)


if __name__ == "__main__":
    main()
