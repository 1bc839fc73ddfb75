"""The engines with their constructor defaults against a tight max_model_len, on a CPU.

A checkpoint's max_position_embeddings sets the default max_model_len (every HF Ouro checkpoint
says 65,536). Before decode was sized by the live context, `LLM(model)` on such a checkpoint
decoded every step at that width. This runs, for the torch engine (dense, WISE, speculative with
WISE drafts) and the JAX engine (dense, WISE), C prompts of L random tokens and N greedy new
tokens each with `LLM(model)` (the defaults, max_model_len = max_position_embeddings) and with
`max_model_len = --tight`, each (engine, arm, sizing) in a fresh process: one untimed warm-up
call, then --repeats timed calls of `generate`; the best is reported. Writes defaults_cpu.json
and defaults_cpu.md to --out.

    python -m benchmarks.engine.defaults_cpu --out benchmarks/results/cpu-2026-12-03/defaults
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from pathlib import Path

from benchmarks import report as rp

ARMS = {"torch": ("dense", "wise", "spec-wise"), "jax": ("dense", "wise")}
TARGET = 1.5   # the defaults within this factor of the tight max_model_len's time


def _config(max_position_embeddings: int):
    from wise_core.presets import PRESETS
    return dataclasses.replace(PRESETS["test-tiny"], max_position_embeddings=max_position_embeddings)


def _prompts(spec: dict) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, spec["context"]).tolist() for _ in range(spec["batch"])]


def _torch_run(spec: dict):
    import torch
    import wise_torch
    from wise_core.checkpoint import random_tensors
    from wise_core.sampling_params import SamplingParams
    from wise_core.speculative_config import SpeculativeConfig
    from wise_core.wise_config import WiseConfig
    from wise_serve.model import build_engine
    torch.set_num_threads(1)
    config = _config(spec["max_position_embeddings"])
    model = wise_torch.from_tensors(config, random_tensors(config, seed=0, std=0.08))
    kw = {} if spec["sizing"] == "defaults" else {"max_model_len": spec["tight"]}
    if spec["arm"] == "wise":
        kw["wise_config"] = WiseConfig()
    if spec["arm"] == "spec-wise":
        kw.update(wise_config=WiseConfig(), speculative_config=SpeculativeConfig("wise", num_draft=4))
    llm = build_engine("torch", model, **kw)
    params = SamplingParams(max_tokens=spec["new_tokens"], ignore_eos=True)
    return llm, lambda: [o.token_ids for o in llm.generate(_prompts(spec), params, use_tqdm=False)]


def _jax_run(spec: dict):
    import wise_jax
    from wise_core.checkpoint import random_tensors
    from wise_core.sampling_params import SamplingParams
    from wise_core.wise_config import WiseConfig
    from wise_serve.model import build_engine
    config = _config(spec["max_position_embeddings"])
    params = wise_jax.from_checkpoint_tensors(config, random_tensors(config, seed=0, std=0.08))
    kw = {} if spec["sizing"] == "defaults" else {"max_model_len": spec["tight"]}
    llm = build_engine("jax", params, config=config, wise_config=WiseConfig() if spec["arm"] == "wise" else None,
                       **kw)
    sampling = SamplingParams(max_tokens=spec["new_tokens"], ignore_eos=True)
    return llm, lambda: [o.token_ids for o in llm.generate(_prompts(spec), sampling, use_tqdm=False)]


def worker(spec: dict) -> dict:
    llm, call = (_torch_run if spec["engine"] == "torch" else _jax_run)(spec)
    start = time.perf_counter()
    tokens = call()                                   # warm-up: compiles (JAX), first allocations
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    stats = llm.stats()
    return dict(warmup_s=warmup_s, times_s=times, best_s=min(times), tokens=tokens,
                max_model_len=llm.max_model_len, step_programs=stats.step_programs,
                step_program_bound=stats.step_program_bound, pool_sizing=stats.pool_sizing)


def run_one(spec: dict, timeout: float) -> dict:
    return rp.run_worker("engine.defaults_cpu", spec, timeout, OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [f"# Constructor defaults against a tight max_model_len, CPU ({report['date']})", "",
             f"{report['machine']}; {a['batch']} prompts x {a['context']} tokens, {a['new_tokens']} new tokens each, "
             f"test-tiny shape with max_position_embeddings {a['max_position_embeddings']}; tight max_model_len "
             f"{a['tight']}; best of {a['repeats']} timed `generate` calls after a warm-up, a fresh process per row.",
             "", "| engine | arm | defaults s | tight s | defaults / tight | within 1.5x | same tokens | "
             "programs (defaults) |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        d, t = r["defaults"], r["tight"]
        if "error" in d or "error" in t:
            lines.append(f"| {r['engine']} | {r['arm']} | error | | | | | |")
            continue
        lines.append(f"| {r['engine']} | {r['arm']} | {d['best_s']:.3f} | {t['best_s']:.3f} | {r['ratio']:.2f} | "
                     f"{'yes' if r['ratio'] <= TARGET else 'no'} | {'yes' if d['tokens'] == t['tokens'] else 'no'} | "
                     f"{d['step_programs']} of {d['step_program_bound']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=20)
    p.add_argument("--tight", type=int, default=256, help="max_model_len of the tight rows")
    p.add_argument("--max-position-embeddings", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engines", default="torch,jax")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    if args.out is None:
        p.error("--out is required")
    base = dict(batch=args.batch, context=args.context, new_tokens=args.new_tokens, tight=args.tight,
                max_position_embeddings=args.max_position_embeddings, repeats=args.repeats)
    rows = []
    for engine in args.engines.split(","):
        for arm in ARMS[engine]:
            result = {s: run_one(dict(base, engine=engine, arm=arm, sizing=s), args.timeout)
                      for s in ("defaults", "tight")}
            row = dict(engine=engine, arm=arm, **result)
            if "error" not in result["defaults"] and "error" not in result["tight"]:
                row["ratio"] = result["defaults"]["best_s"] / result["tight"]["best_s"]
            rows.append(row)
            print(engine, arm, {k: v.get("best_s", v.get("error", "")[-200:]) for k, v in result.items()}, flush=True)
    env = rp.environment()
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  machine=f"{env['cpu']}, {env['cpu_count']} cores, Python {env['python']}",
                  args={k: v for k, v in vars(args).items() if k not in ("out", "worker")}, rows=rows)
    print(rp.write_report(args.out, "defaults_cpu", report, markdown(report)))
    return report


if __name__ == "__main__":
    main()
