"""Automatic prefix caching on a shared-system-prompt workload: prefill tokens saved and TTFT.

R requests (default 64) arrive at once, each a common prefix of P tokens (default 1,024: a
system prompt) and its own suffix of S tokens (default 128), and generate N greedy tokens. The
engine runs with `enable_prefix_caching` on and off, each arm in a fresh process: one untimed
warm-up workload on an engine of its own (first allocations; the JAX engine's compiles), then
--repeats workloads, each on a fresh engine (an engine keeps its cache). Reported per arm: the
prompt tokens prefilled and those found cached, the time to first token of each request (from
the moment all were queued to the `step` that returned its first token: mean, p50, p90, max),
and the workload's wall time; the best repeat by wall time is shown. Tokens are compared
between the arms. Requests prefilled in the same step find nothing cached (a page is cached
once the prefill that writes it is launched), so the first step's requests (as many as
max_num_batched_tokens holds) compute the prefix; the later ones share it.

    python3 -m benchmarks.engine.prefix_cache --out benchmarks/results/cpu-2026-12-05/prefix-cache
    python3 -m benchmarks.engine.prefix_cache --engines torch --preset ouro-1.4b --out OUT   # a GPU, random bf16
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from benchmarks import report as rp


def _prompts(spec: dict, vocab: int) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, vocab, spec["prefix"]).tolist()
    return [prefix + rng.integers(0, vocab, spec["suffix"]).tolist() for _ in range(spec["requests"])]


def _engine_factory(spec: dict):
    """(a function making a fresh engine (`build_engine`), its SamplingParams class, the vocabulary size)."""
    from wise_core.checkpoint import random_tensors
    from wise_core.presets import PRESETS
    from wise_core.sampling_params import SamplingParams
    from wise_serve.model import build_engine
    kw = dict(enable_prefix_caching=spec["arm"] == "on", max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_model_len=spec["prefix"] + spec["suffix"] + spec["new_tokens"])
    if spec["engine"] == "torch":
        import torch
        import wise_torch
        if spec["preset"]:              # drawn on the device, as the throughput benchmark's
            from benchmarks.engine.workload import random_model
            cuda = torch.cuda.is_available()
            model = random_model(dict(dtype="bfloat16" if cuda else "float32", device="cuda" if cuda else "cpu",
                                      std=0.02, seed=0, q_scale=1.0), PRESETS[spec["preset"]])
        else:
            model = wise_torch.load_model(spec["model"])
        return (lambda: build_engine("torch", model, **kw)), SamplingParams, model.config.vocab_size
    import jax
    import jax.numpy as jnp
    import wise_jax
    if spec["preset"]:
        config = PRESETS[spec["preset"]]
        dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
        params = wise_jax.from_checkpoint_tensors(config, random_tensors(config, seed=0), dtype=dtype)
    else:
        config, params = wise_jax.load_model(spec["model"], layers="unstacked")
    return (lambda: build_engine("jax", params, config=config, **kw)), SamplingParams, config.vocab_size


def _workload(llm, prompts, params) -> dict:
    start = time.perf_counter()
    ids = {llm.add_request(p, params): i for i, p in enumerate(prompts)}
    ttft, tokens = {}, {}
    while llm.has_unfinished():
        for out in llm.step():
            i = ids[out.request_id]
            if i not in ttft and out.token_ids:
                ttft[i] = time.perf_counter() - start
            if out.finished:
                tokens[i] = out.token_ids
    wall = time.perf_counter() - start
    s = llm.stats()
    return dict(wall_s=wall, ttft_s=[ttft[i] for i in range(len(prompts))], prompt_tokens=s.prompt_tokens,
                cache_hits=s.prefix_cache_hits, cache_queries=s.prefix_cache_queries,
                tokens=[tokens[i] for i in range(len(prompts))])


def worker(spec: dict) -> dict:
    make, sampling, vocab = _engine_factory(spec)
    prompts = _prompts(spec, vocab)
    params = sampling(max_tokens=spec["new_tokens"], ignore_eos=True)
    _workload(make(), prompts, params)                       # warm-up
    runs = [_workload(make(), prompts, params) for _ in range(spec["repeats"])]
    best = min(runs, key=lambda r: r["wall_s"])
    return dict(best, walls_s=[r["wall_s"] for r in runs])


def run_one(spec: dict, timeout: float) -> dict:
    return rp.run_worker("engine.prefix_cache", spec, timeout, PYTHONUNBUFFERED="1")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def markdown(report: dict) -> str:
    a = report["args"]
    model = f"{a['preset']} (random weights)" if a["preset"] else a["model"]
    lines = [f"# Prefix caching on a shared-system-prompt workload ({report['date']})", "",
             f"{report['machine']}; {model}; {a['requests']} requests at once, each a common {a['prefix']}-token "
             f"prefix and its own {a['suffix']}-token suffix, {a['new_tokens']} greedy new tokens, "
             f"max_num_batched_tokens {a['max_num_batched_tokens']}; best of "
             f"{a['repeats']} workloads (fresh engine each) after a warm-up, a fresh process per arm. TTFT from "
             "the moment every request was queued.", "",
             "| engine | prefix caching | prompt tokens prefilled | found cached | TTFT mean s | p50 | p90 | max | "
             "wall s | same tokens as off |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['arm']} | error | | | | | | | |")
            continue
        t = r["ttft_s"]
        lines.append(f"| {r['engine']} | {r['arm']} | {r['prompt_tokens']:,} | {r['cache_hits']:,} | "
                     f"{sum(t) / len(t):.3f} | {_quantile(t, 0.5):.3f} | {_quantile(t, 0.9):.3f} | {max(t):.3f} | "
                     f"{r['wall_s']:.3f} | {r.get('same_tokens', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--suffix", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's step budget (its default)")
    p.add_argument("--model", default="ouro-py-3m", help="built-in name or checkpoint directory")
    p.add_argument("--preset", default=None, help="a wise_core PRESETS shape with random weights instead")
    p.add_argument("--engines", default="torch,jax")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    if args.out is None:
        p.error("--out is required")
    base = dict(requests=args.requests, prefix=args.prefix, suffix=args.suffix, new_tokens=args.new_tokens,
                model=args.model, preset=args.preset, repeats=args.repeats,
                max_num_batched_tokens=args.max_num_batched_tokens)
    rows = []
    for engine in args.engines.split(","):
        arms = {arm: run_one(dict(base, engine=engine, arm=arm), args.timeout) for arm in ("off", "on")}
        for arm, result in arms.items():
            row = dict(engine=engine, arm=arm, **result)
            if "error" not in result and "error" not in arms["off"]:
                row["same_tokens"] = "yes" if result["tokens"] == arms["off"]["tokens"] else "no"
            rows.append(row)
            print(engine, arm, {k: result.get(k) for k in ("wall_s", "prompt_tokens", "cache_hits", "error")},
                  flush=True)
    env = rp.environment()
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  machine=f"{env['cpu']}, {env['cpu_count']} cores, Python {env['python']}", environment=env,
                  args={k: v for k, v in vars(args).items() if k not in ("out", "worker")}, rows=rows)
    print(rp.write_report(args.out, "prefix_cache", report, markdown(report)))
    return report


if __name__ == "__main__":
    main()
