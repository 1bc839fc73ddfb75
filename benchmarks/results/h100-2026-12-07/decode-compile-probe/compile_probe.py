"""Design probe: compile and run time of the JAX dense decode step, Ouro-1.4B shape, random bf16:
'unrolled' (model.decode_step: 4 loops x 24 unstacked layers, straight-line) vs 'loopscan'
(a lax.scan over the 4 loops, the 24 layers unrolled in its body, the plane index traced)."""
import os, sys, time, json, dataclasses
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from wise_core.config import PRESETS, WiseConfig
from wise_core import modes as M
import wise_jax
from wise_jax import model, kv_cache as kvc
from wise_jax.params import unstack_layers, scale_queries
from wise_jax.attention import decode_attention, resolve_kernel

config = PRESETS[os.environ.get("PRESET", "ouro-1.4b")]
params = unstack_layers(scale_queries(config, wise_jax.init_params(config, jax.random.PRNGKey(0), dtype=jnp.dtype(os.environ.get("DTYPE", "bfloat16"))), 8.0))
kernel = resolve_kernel("auto", config.head_dim)
L = config.num_hidden_layers

def loopscan_step(params, cache, tokens, slots, width):
    batch = tokens.shape[0]
    positions = cache.seq_lens
    active = slots >= 0
    cache, fits = kvc.try_reserve(cache, jnp.where(active, positions + 1, positions), width)
    live = active & fits
    seq_lens = jnp.where(live, cache.seq_lens, 1)
    h = model.embed(params, tokens)[:, None]
    cos, sin = model.rope(positions[:, None], config.head_dim, config.rope_theta)
    dense = WiseConfig()
    modes = jnp.full((batch,), M.DENSE, jnp.int32)
    support = jnp.zeros((batch, config.num_attention_heads, width * cache.page_size // dense.block_size), bool)
    def one_loop(carry, loop):
        h, cache = carry
        def attend(q, k, v, layer, cache):
            plane = loop * L + layer
            cache = kvc.write_token(cache, plane, k[:, 0], v[:, 0], live)
            kp, vp, table = kvc.plane_pages(cache, plane, width)
            out, _ = decode_attention(q[:, 0], kp, vp, table, seq_lens, modes, support, block_size=dense.block_size,
                                      eta=dense.eta, kernel=kernel, validate=False)
            return out[:, None], cache
        h, cache = model.run_loop(params, config, h, cos, sin, attend, cache)
        return (h, cache), None
    # run_loop ends with the final norm; the next loop starts from it (as decode_step does)
    (h, cache), _ = lax.scan(one_loop, (h, cache), jnp.arange(config.total_ut_steps, dtype=jnp.int32))
    return model.head(params, h[:, 0]), cache

def unrolled_step(params, cache, tokens, slots, width):
    logits, cache, _ = model.decode_step(params, config, cache, None, tokens, slots, wise_config=None,
                                         kernel=kernel, width=width)
    return logits, cache

def make_cache(batch, ctx, page_size=128):
    pages = -(-(ctx + 64) // page_size)
    cache = kvc.create(config, batch=batch, max_pages=pages, num_pages=batch * pages + 1, page_size=page_size,
                       dtype=jnp.dtype(os.environ.get("DTYPE", "bfloat16")))
    table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    free = np.zeros(batch * pages + 1, np.int32); free[0] = batch * pages
    return dataclasses.replace(cache, page_table=jnp.asarray(table), seq_lens=jnp.full((batch,), ctx, jnp.int32),
                               free_pages=jnp.asarray(free), num_free=jnp.asarray(1, jnp.int32)), pages

res = []
import re
SHAPES = [tuple(int(x) for x in s.split("x")) for s in os.environ.get("SHAPES", "1024x16,1024x1").split(",")]
VARIANTS = os.environ.get("VARIANTS", "loopscan,unrolled").split(",")
for ctx, batch in SHAPES:
    for name in VARIANTS:
        fn = dict(loopscan=loopscan_step, unrolled=unrolled_step)[name]
        cache, pages = make_cache(batch, ctx)
        width = pages
        jitted = jax.jit(fn, static_argnames=("width",), donate_argnums=(1,))
        tokens = jnp.arange(batch, dtype=jnp.int32); slots = jnp.arange(batch, dtype=jnp.int32)
        t0 = time.perf_counter(); lowered = jitted.lower(params, cache, tokens, slots, width=width)
        t1 = time.perf_counter(); compiled = lowered.compile(); t2 = time.perf_counter()
        m = compiled.memory_analysis()
        txt = compiled.as_text()
        dump = os.environ.get("DUMP")
        pool = "%d,%d,%d,%d,%d" % cache.k.shape
        flat = "%d,%d,%d,%d" % ((cache.k.shape[0] * cache.k.shape[1],) + cache.k.shape[2:])
        big = [l.strip()[:300] for l in txt.splitlines() if ("[" + pool + "]") in l or ("[" + flat + "]") in l]
        if dump:
            open(f"{dump}/{name}_{ctx}x{batch}.hlo.txt", "w").write(txt)
        r = dict(variant=name, batch=batch, ctx=ctx, trace_lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2),
                 pool_gib=round(2 * cache.k.nbytes / 2**30, 2), temp_gib=round(m.temp_size_in_bytes / 2**30, 3),
                 alias_gib=round(m.alias_size_in_bytes / 2**30, 3),
                 pool_ops=sorted(set(m_.group(1) for l in big for m_ in [re.search(r"= .*?[ ]([a-z][a-z0-9-]*)[(]", l)] if m_)))
        print(json.dumps(r), flush=True)
        try:
            out, cache = compiled(params, cache, tokens, slots); out.block_until_ready()
            times = []
            for i in range(12):
                cache = dataclasses.replace(cache, seq_lens=jnp.full((batch,), ctx, jnp.int32), num_free=jnp.asarray(1, jnp.int32))
                s = time.perf_counter(); out, cache = compiled(params, cache, tokens, slots); out.block_until_ready()
                times.append(time.perf_counter() - s)
            r.update(step_ms_median=round(1e3 * float(np.median(times[2:])), 3), step_ms_min=round(1e3 * min(times), 3),
                     kernel=kernel, checksum=float(jnp.abs(out.astype(jnp.float32)).sum()))
        except Exception as e:
            r.update(error=str(e)[:300])
        print(json.dumps(r), flush=True); res.append(r)
        del cache, compiled, lowered
