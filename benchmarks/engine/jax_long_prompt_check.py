"""Long prompts on a CPU: wise_jax.generate against wise_torch.generate, time and peak memory.

    python -m benchmarks.engine.jax_long_prompt_check --out benchmarks/results/DIR

The case of issue 12: a tiny random model (test-tiny: 2 layers x 4 loops, hidden 128, fp32, with
max_position_embeddings raised to 16384) prefills prompts of 12,000 and 6,000 tokens and decodes
--new-tokens greedy tokens (no eos). Each framework runs in its own process (its peak RSS is that
process's `ru_maxrss`); both get the same weights (`random_tensors`, seed 0) and prompts. The
check: the same tokens, and JAX's peak RSS within --rss-limit-gb (3 GB). Writes
jax_long_prompt_check.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import time
from pathlib import Path

from benchmarks import report as rp

STEM = "jax_long_prompt_check"


def _case(args):
    import dataclasses

    import numpy as np

    from wise_core.checkpoint import random_tensors
    from wise_core.presets import PRESETS
    config = dataclasses.replace(PRESETS["test-tiny"], max_position_embeddings=16384)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in args.lengths]
    return config, random_tensors(config, seed=0, std=0.02), prompts


def worker(args) -> dict:
    config, tensors, prompts = _case(args)
    start = time.perf_counter()
    if args.worker == "jax":
        import jax
        import wise_jax
        params = wise_jax.from_checkpoint_tensors(config, tensors)
        del tensors
        out = wise_jax.generate(params, config, prompts, max_new_tokens=args.new_tokens, eos_token_id=None)
        versions = {"jax": jax.__version__}
    else:
        import torch
        import wise_torch
        model = wise_torch.from_tensors(config, tensors)
        del tensors
        out = wise_torch.generate(model, prompts, max_new_tokens=args.new_tokens, eos_token_id=None)
        versions = {"torch": torch.__version__}
    wall = time.perf_counter() - start
    return dict(framework=args.worker, tokens=out.tokens, wall_s=wall, prefill_s=out.stats.prefill_s,
                decode_s=out.stats.decode_s, peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                versions=versions)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[12000, 6000])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--frameworks", default="jax,torch")
    p.add_argument("--rss-limit-gb", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=rp.RESULTS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    runs, load = {}, [os.getloadavg()[0]]
    for framework in args.frameworks.split(","):
        cmd = rp.module_command(f"engine.{STEM}", "--worker", framework, "--new-tokens", str(args.new_tokens),
                                "--lengths", ",".join(map(str, args.lengths)))
        done = subprocess.run(cmd, capture_output=True, text=True, env=rp.module_env(JAX_PLATFORMS="cpu"))
        if done.returncode != 0:
            raise SystemExit(f"{framework} worker failed:\n{done.stderr[-3000:]}")
        runs[framework] = json.loads(done.stdout.strip().splitlines()[-1])
        load.append(os.getloadavg()[0])
        r = runs[framework]
        print(f"{framework}: {r['wall_s']:.1f} s (prefill {r['prefill_s']:.1f} s, decode {r['decode_s']:.1f} s), "
              f"peak RSS {r['peak_rss_gb']:.2f} GB", flush=True)
    env = rp.environment()
    report = dict(date=rp.now(), host=env["host"], python=env["python"], cpus=env["cpu_count"],
                  load_average=load, lengths=args.lengths,
                  new_tokens=args.new_tokens, runs=runs)
    if "jax" in runs:
        report["jax_within_rss_limit"] = runs["jax"]["peak_rss_gb"] <= args.rss_limit_gb
    if {"jax", "torch"} <= set(runs):
        report["same_tokens"] = runs["jax"]["tokens"] == runs["torch"]["tokens"]
    lines = [f"# Long prompts on a CPU ({report['date']}, {report['host']}, python {report['python']})", "",
             f"test-tiny (2 layers x 4 loops, fp32, random weights), prompts of {args.lengths} tokens, "
             f"{args.new_tokens} greedy new tokens; each framework in its own process. {os.cpu_count()} CPUs; "
             f"1-minute load average before, between and after the runs: {', '.join(f'{x:.1f}' for x in load)} "
             f"(other jobs share the machine).", "",
             "| framework | versions | wall s | prefill s | decode s | peak RSS GB |", "|---|---|---|---|---|---|"]
    for r in runs.values():
        lines.append(f"| {r['framework']} | {', '.join(f'{k} {v}' for k, v in r['versions'].items())} | "
                     f"{r['wall_s']:.1f} | {r['prefill_s']:.1f} | {r['decode_s']:.1f} | {r['peak_rss_gb']:.2f} |")
    lines.append("")
    if "same_tokens" in report:
        lines.append(f"Same greedy tokens: {'yes' if report['same_tokens'] else 'NO'}.")
    if "jax_within_rss_limit" in report:
        within = "yes" if report["jax_within_rss_limit"] else "NO"
        lines.append(f"JAX peak RSS within {args.rss_limit_gb} GB: {within}.")
    print(rp.write_report(args.out, STEM, report, "\n".join(lines) + "\n"), end="")
    return report


if __name__ == "__main__":
    main()
