"""Huginn decode steps at fixed depth, with adaptive depth riding along, and regrouped (torch, eager).

    python -m benchmarks.engine.adaptive_depth --out benchmarks/results/cpu-2026-12-05/adaptive-depth

`--batch` held-out stdlib contexts of `--context` tokens (`stdlib_corpus`, the model's tokenizer)
are prefilled alone (every iteration), then decode `--new-tokens` greedy tokens as one batch
through `HuginnForCausalLM.decode_step` (`parity.huginn.torch_generate`: the paged cache, the
reference decode attention, initial state seed 0), each step timed. Arms, each decoding its own
greedy tokens:
- fixed: every token runs `--depth` core iterations;
- ride-along: `AdaptiveDepth(threshold)` (the released KL exit criterion, at most `--depth`): rows
  that exit are held and every iteration still runs every row (static shapes, what the engines
  run, CUDA-graph safe);
- regroup: the same exits, and after each checked iteration only the rows still running run the
  later ones (`decode_step(regroup=True)`: gathered rows, dynamic shapes, eager only).
Reported per arm and batch size: the mean decode step time (the best of `--repeats` runs, arms
interleaved, after an untimed warm-up; `--threads` torch threads), tokens/s, the mean core iterations a decoded token ran (the step's `depths`), and
for regroup whether its tokens and depths equal ride-along's. Both adaptive arms run a check
(the coda and the head on every running row) after each iteration but the last.

Writes adaptive_depth.json (every step time, the settings, machine, versions, date) and
adaptive_depth.md into `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

from benchmarks import report as rp

ARMS = ("fixed", "ride-along", "regroup")


def run_arm(model, prompts: list[list[int]], arm: str, args) -> dict:
    """One decode run of `arm` -> its step times, tokens and depths."""
    from parity.huginn import torch_generate
    from wise_core.adaptive_depth import AdaptiveDepth
    times, depths = [], [[] for _ in prompts]
    adaptive = None if arm == "fixed" else AdaptiveDepth(threshold=args.threshold)
    tokens, _, _ = torch_generate(model, prompts, max_new_tokens=args.new_tokens + 1, num_steps=args.depth,
                                  adaptive=adaptive, depths=depths, regroup=arm == "regroup", step_times=times)
    return dict(step_s=times, tokens=tokens, depths=depths)


def run(args) -> dict:
    import torch
    from benchmarks.quality import stdlib_corpus
    from wise_torch.loading import load_model
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32, device="cpu")
    if model.config.architecture != "huginn":
        raise SystemExit(f"{args.model} is an {model.config.architecture} model; this benchmark measures Huginn")
    _, held = stdlib_corpus.split_files(stdlib_corpus.list_files())
    stream = stdlib_corpus.token_stream(held, tokenizer=model.tokenizer, separator=model.config.bos_token_id)
    rows = []
    for batch in args.batch:
        prompts = [c for c, _ in stdlib_corpus.sample_contexts(stream, batch, args.context, args.context, 1,
                                                                 seed=args.seed)]
        runs = {arm: [] for arm in ARMS}
        for arm in ARMS:                    # warm-up (first allocations), untimed
            run_arm(model, prompts[:2], arm, argparse.Namespace(**dict(vars(args), new_tokens=2)))
        for _ in range(args.repeats):      # arms interleaved: a load change hits each alike
            for arm in ARMS:
                runs[arm].append(run_arm(model, prompts, arm, args))
        for arm in ARMS:
            best = min(runs[arm], key=lambda r: sum(r["step_s"]))
            flat = [d for row in best["depths"] for d in row]
            row = dict(batch=batch, arm=arm, step_ms=1e3 * sum(best["step_s"]) / len(best["step_s"]),
                       mean_depth=sum(flat) / len(flat), runs_step_s=[r["step_s"] for r in runs[arm]],
                       depths=best["depths"])
            row["tokens_per_s"] = batch / (row["step_ms"] / 1e3)
            if arm == "regroup":
                ride = runs["ride-along"][0]
                row["same_as_ride_along"] = all(r["tokens"] == ride["tokens"] and r["depths"] == ride["depths"]
                                                for r in runs[arm])
            rows.append(row)
            print(batch, arm, f"{row['step_ms']:.1f} ms/step, mean depth {row['mean_depth']:.2f}", flush=True)
    env = rp.environment("torch")
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=f"{env['cpu']}, {env['cpu_count']} cores, torch threads {torch.get_num_threads()}",
                environment=env, args={k: v for k, v in vars(args).items() if k != "out"}, rows=rows)


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [f"# Huginn adaptive depth: riding along against regrouping ({report['date']})", "",
             f"{report['machine']}; {a['model']} (float32, eager torch, the reference decode attention); "
             f"held-out contexts of {a['context']} tokens, {a['new_tokens']} greedy decode steps per run; at most "
             f"{a['depth']} core iterations, adaptive arms KL < {a['threshold']:g}; best of {a['repeats']} runs "
             "(arms interleaved).", ""]
    lines += rp.table(["batch", "arm", "ms / step", "tokens/s", "mean depth", "speed vs fixed", "tokens and depths"],
                      [[r["batch"], r["arm"], rp.fmt(r["step_ms"]), rp.fmt(r["tokens_per_s"]),
                        rp.fmt(r["mean_depth"], ".2f"),
                        rp.fmt(next(f["step_ms"] for f in report["rows"] if f["batch"] == r["batch"]
                                    and f["arm"] == "fixed") / r["step_ms"], ".2f") + "x",
                        {True: "= ride-along", False: "differ from ride-along"}.get(r.get("same_as_ride_along"), "")]
                       for r in report["rows"]])
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="huginn-py-3m", help="built-in name or checkpoint directory (Huginn)")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--depth", type=int, default=8, help="core iterations: fixed depth, adaptive depth's most")
    p.add_argument("--threshold", type=float, default=1e-2, help="AdaptiveDepth.threshold")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="the contexts' offsets")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a shared machine more threads oversubscribe the cores)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    report = run(args)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(rp.write_report(args.out, "adaptive_depth", report, markdown(report)))
    return report


if __name__ == "__main__":
    main()
