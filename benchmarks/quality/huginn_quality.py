"""Huginn decode quality on held-out text: WISE against dense, adaptive depth against fixed depth.

    python -m benchmarks.quality.huginn_quality [--model huginn-py-3m] [--n-contexts 16] --out DIR

Contexts of `--min-context`..`--max-context` tokens cut at seeded offsets from the held-out stdlib
files (`stdlib_corpus`, the model's tokenizer), each followed by `--continuation` held-out tokens.
Each arm prefills the context densely at its iteration count (prefill runs every iteration, as
released), then decodes one token a call with `wise_core.huginn_reference.huginn_forward` (the
numpy specification, float64 on the checkpoint's weights; initial state seed 0 for every arm):
- teacher-forced: bits per byte of the continuation (mean NLL in bits over byte targets), and
  the tokens changed: the fraction of its positions whose argmax differs from the dense arm's of
  the same maximum depth;
- greedy: `--greedy` tokens from the context; the fraction past the common prefix with that
  dense arm's greedy tokens (greedy tokens changed);
- adaptive depth: the mean core iterations a decoded token ran (the released KL exit criterion,
  `AdaptiveDepth`, at each `--thresholds`, at most the arm's maximum depth).
Arms: dense at each of `--depths`; WISE (`huginn_wise_config`: discovery on iterations 0 and 1,
reuse on the rest) at each depth; adaptive depth at the largest depth per threshold. Differences
carry a paired bootstrap 95% interval over contexts (`wise_core.evaluation.paired_bootstrap`).

Writes huginn_quality.json (every per-context value, the settings, machine, versions, date) and
huginn_quality.md into `--out`. On 2 shared CPU cores the defaults on `huginn-py-3m` take ~7 minutes.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import platform
import time
from pathlib import Path

import numpy as np

from benchmarks import report as rp
from benchmarks.quality import stdlib_corpus
from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.checkpoint import load_checkpoint
from wise_core.evaluation import common_prefix, interval, paired_bootstrap
from wise_core.huginn_reference import HuginnCache, huginn_forward, huginn_weights
from wise_core.wise_config import huginn_wise_config

N_BYTES = 256


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def decode_arm(config, weights, context: list[int], continuation: list[int], greedy: int, num_steps: int,
               wise=None, adaptive=None) -> dict:
    """One arm on one context: teacher-forced log p and argmax of each continuation token, greedy
    tokens, and the iterations each decoded token ran."""
    cache = HuginnCache()
    last = huginn_forward(config, weights, context, num_steps=num_steps, cache=cache)[-1]
    prefilled = copy.deepcopy(cache)
    logp, argmax, logits = [], [], last
    for token in continuation:
        logp.append(float(log_softmax(logits)[token]))
        argmax.append(int(np.argmax(logits)))
        logits = huginn_forward(config, weights, [token], num_steps=num_steps, cache=cache, wise=wise,
                                adaptive=adaptive)[0]
    depths = cache.depths[len(context):]
    cache, logits, tokens = prefilled, last, []
    for _ in range(greedy):
        tokens.append(int(np.argmax(logits)))
        logits = huginn_forward(config, weights, tokens[-1:], num_steps=num_steps, cache=cache, wise=wise,
                                adaptive=adaptive)[0]
    depths += cache.depths[len(context):]
    return {"logp": logp, "argmax": argmax, "greedy": tokens, "depths": depths}


def bits_per_byte(logp: list[float], targets: list[int]) -> float:
    """Mean NLL in bits over the targets that are bytes."""
    nll = [-lp / math.log(2) for lp, t in zip(logp, targets) if t < N_BYTES]
    return float(np.mean(nll)) if nll else float("nan")


def run(args) -> dict:
    checkpoint = load_checkpoint(args.model)
    config = checkpoint.config
    if config.architecture != "huginn":
        raise SystemExit(f"{args.model} is an {config.architecture} model; this benchmark measures Huginn models")
    weights = huginn_weights(config, checkpoint.tensors)
    _, held = stdlib_corpus.split_files(stdlib_corpus.list_files())
    stream = stdlib_corpus.token_stream(held, tokenizer=checkpoint.tokenizer, separator=config.bos_token_id)
    pairs = stdlib_corpus.sample_contexts(stream, args.n_contexts, args.min_context, args.max_context,
                                          args.continuation, seed=args.seed)
    deepest = max(args.depths)
    arms = [(f"dense r={d}", d, None, None) for d in args.depths]
    arms += [(f"WISE r={d}", d, huginn_wise_config(d, block_size=args.block_size, eta=args.eta), None)
             for d in args.depths]
    arms += [(f"adaptive KL<{t:g} r<={deepest}", deepest, None, AdaptiveDepth(threshold=t)) for t in args.thresholds]
    results, seconds = {}, {}
    for name, depth, wise, adaptive in arms:
        start = time.perf_counter()
        results[name] = [decode_arm(config, weights, c, cont, args.greedy, depth, wise, adaptive) for c, cont in pairs]
        seconds[name] = round(time.perf_counter() - start, 1)
        if not args.quiet:
            print(f"{name}: {seconds[name]} s", flush=True)
    rows = []
    for name, depth, wise, adaptive in arms:
        base = results[f"dense r={depth}"]
        bpb = np.array([bits_per_byte(r["logp"], cont) for r, (_, cont) in zip(results[name], pairs)])
        base_bpb = np.array([bits_per_byte(r["logp"], cont) for r, (_, cont) in zip(base, pairs)])
        forced_changed = np.array([np.mean(np.array(r["argmax"]) != np.array(b["argmax"]))
                                   for r, b in zip(results[name], base)])
        greedy_changed = np.array([1 - common_prefix(r["greedy"], b["greedy"]) / args.greedy
                                   for r, b in zip(results[name], base)])
        depths = [d for r in results[name] for d in r["depths"]]
        row = {"arm": name, "max_depth": depth, "against": f"dense r={depth}",
               "bits_per_byte": float(bpb.mean()), "mean_depth": float(np.mean(depths)),
               "forced_tokens_changed": float(forced_changed.mean()),
               "greedy_tokens_changed": float(greedy_changed.mean()), "seconds": seconds[name],
               "per_context": {"bits_per_byte": bpb.tolist(), "forced_tokens_changed": forced_changed.tolist(),
                               "greedy_tokens_changed": greedy_changed.tolist()}}
        if name != row["against"]:
            row["bpb_diff"] = interval(paired_bootstrap(bpb, base_bpb, seed=args.seed))
        rows.append(row)
    return {"model": str(args.model), "config": config.to_dict(), "rows": rows,
            "settings": {"depths": args.depths, "thresholds": args.thresholds, "eta": args.eta,
                         "block_size": args.block_size, "wise_profile": "huginn_wise_config: discover 0, 1; "
                                                                         "reuse 2 .. r - 1",
                         "n_contexts": len(pairs), "context_lengths": [len(c) for c, _ in pairs],
                         "continuation": args.continuation, "greedy": args.greedy, "seed": args.seed,
                         "engine": "wise_core.huginn_reference.huginn_forward (numpy, float64), initial state seed 0"},
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "processor": platform.processor()},
            "versions": {n: rp.version(n) for n in ("numpy",)},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# Huginn decode quality: {result['model']}", "",
             f"{s['n_contexts']} held-out stdlib contexts ({min(s['context_lengths'])}-{max(s['context_lengths'])} "
             f"tokens), {s['continuation']} teacher-forced and {s['greedy']} greedy tokens each; {s['engine']}. "
             f"WISE: {s['wise_profile']}, eta {s['eta']}, blocks of {s['block_size']}. Tokens changed: against "
             f"dense decode at the arm's (maximum) depth; forced: argmax over the teacher-forced continuation; "
             f"greedy: the fraction past the common prefix. {result['date']}.", "",
             "| arm | bits/byte | diff vs dense (95% CI) | mean depth | forced tokens changed | "
             "greedy tokens changed | s |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        d = r.get("bpb_diff")
        diff = f"{d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]" if d else "-"
        lines.append(f"| {r['arm']} | {r['bits_per_byte']:.4f} | {diff} | {r['mean_depth']:.2f} | "
                     f"{r['forced_tokens_changed']:.3f} | {r['greedy_tokens_changed']:.3f} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="huginn-py-3m", help="Huginn checkpoint directory or built-in model name")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n-contexts", type=int, default=16)
    ap.add_argument("--min-context", type=int, default=128)
    ap.add_argument("--max-context", type=int, default=192)
    ap.add_argument("--continuation", type=int, default=48, help="teacher-forced tokens per context")
    ap.add_argument("--greedy", type=int, default=16, help="greedy tokens per context")
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8], help="core iterations of the fixed-depth arms")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[1e-3, 1e-2],
                    help="adaptive depth's KL exit thresholds (at the largest depth)")
    ap.add_argument("--eta", type=float, default=0.95)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rp.write_json(args.out / "huginn_quality.json", result)
    (args.out / "huginn_quality.md").write_text(markdown(result))
    if not args.quiet:
        print(markdown(result))
    return result


if __name__ == "__main__":
    main()
