"""Tensor-parallel scaling of the serving engine: decode throughput on 1 and N GPUs, dense and WISE.

    NCCL_NVLS_ENABLE=0 python -m benchmarks.engine.tp_scaling --preset ouro-1.4b --shapes 1024x64 --q-scale 8 \\
        --out benchmarks/results/DIR/tp-1024x64                                          # on 2 x H200
    python -m benchmarks.engine.tp_scaling --preset test-tiny --dtype float32 --device cpu --kernel reference \\
        --shapes 64x3 --new-tokens 5 --out /tmp/tps                                      # CPU smoke (gloo)

Method: throughput.py's -- a cohort of C concurrent requests of exactly L random prompt tokens,
greedy, N new tokens each with ignore_eos; decode is timed from the step in which the whole
cohort has its first token to the last; each (shape, arm, size) runs in a fresh process (its
engine worker) after one untimed warm-up cohort, then --repeats timed cohorts -- with
`LLM(tensor_parallel_size=size)` for each size of --tensor-parallel-size. Every run holds the
same random weights (drawn on rank 0's GPU, broadcast to the others), q_proj scaled by
--q-scale for peaked attention, and a pool of the cohort's pages + 1 on every rank.

Per (shape, arm, size): decode tok/s, ms/step, the per-GPU bandwidth roofline (one GPU reads its
shard's layer weights, the replicated norms, exit gate and LM head, and its heads' K/V:
timing.roofline of the rank's local config) and the share of it reached, the speedup over
the same arm on one GPU, the scaling efficiency (speedup / size), and how many requests' greedy
tokens differ from that arm's on one GPU (in bf16 each all-reduce adds partial sums rounded to
bf16, so requests may part on near ties). Writes tp_scaling.json and tp_scaling.md to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import shutil
import tempfile
from pathlib import Path

from benchmarks import report as rp
from benchmarks.engine import decode_report, speculative_arms, throughput, timing, workload
from benchmarks.engine.arms import CUDA_GRAPHS

ARMS = ("dense", "wise")


def parse_sizes(text: str) -> list[int]:
    """'1,2' -> [1, 2]: distinct positive integers, 1 first (the baseline of the speedups)."""
    try:
        sizes = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not sizes or sizes[0] != 1 or len(set(sizes)) != len(sizes) or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be distinct positive integers starting with 1, got {text!r}")
    return sizes


def parse_arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",")]
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"arms must be distinct names of {ARMS}, got {text!r}")
    return arms


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory or built-in name (default: random --preset weights)")
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--layers", type=int, default=0, help="override the preset's num_hidden_layers")
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--q-scale", type=workload.parse_floats, default=[1.0], help="one value, or one per shape")
    p.add_argument("--shapes", type=workload.parse_shapes, default=workload.parse_shapes("1024x64,8192x20"))
    p.add_argument("--tensor-parallel-size", type=parse_sizes, default=[1, 2], help="sizes to run, 1 first")
    p.add_argument("--arms", type=parse_arms, default=list(ARMS))
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(timing.DTYPE_BYTES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernel", default="triton", choices=("triton", "reference", "auto"))
    p.add_argument("--eta", type=float, default=0.95)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--cuda-graphs", default="auto", choices=sorted(CUDA_GRAPHS))
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--hbm-tbps", type=float, default=timing.HBM_TBPS)
    p.add_argument("--child-timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=rp.RESULTS)
    return p


def check_args(parser: argparse.ArgumentParser, args) -> list[float]:
    if args.new_tokens < 2 or args.warmup_tokens < 1 or args.repeats < 1:
        parser.error("--new-tokens must be >= 2, --warmup-tokens and --repeats >= 1")
    scales = args.q_scale * len(args.shapes) if len(args.q_scale) == 1 else args.q_scale
    if len(scales) != len(args.shapes):
        parser.error(f"--q-scale gives {len(args.q_scale)} values for {len(args.shapes)} shapes (give 1 or one each)")
    return scales


def per_gpu_roofline(config, size: int, dtype: str, context: int, batch: int, new_tokens: int, density,
                     hbm_tbps: float) -> dict:
    """timing.roofline of one rank: its local config (heads, KV heads, MLP columns / size)."""
    from wise_torch.parallel import local_config
    return timing.roofline(local_config(config, size), dtype, context, batch, new_tokens, density, hbm_tbps)


def row_of(spec: dict, result: dict, repeat: int | None, config, args) -> dict:
    row = dict(context=spec["context"], batch=spec["batch"], q_scale=spec["q_scale"], arm=spec["arm"],
               size=spec["tensor_parallel_size"], repeat=repeat, status=result["status"])
    if repeat is None:
        return dict(row, log_tail=result.get("log_tail"))
    r = result["repeats"][repeat]
    density = {int(k): v for k, v in (r.get("density") or {}).items() if v is not None} or None
    roof = per_gpu_roofline(config, row["size"], args.dtype, spec["context"], spec["batch"], args.new_tokens,
                            density, args.hbm_tbps)
    row.update({k: r.get(k) for k in ("decode_tokens_per_s", "ms_per_step", "prefill_s", "fallbacks",
                                      "preemptions", "pages_returned", "tokens")})
    row.update(density=density, roofline_tokens_per_s=roof["tokens_per_s"],
               roofline_share=r["decode_tokens_per_s"] / roof["tokens_per_s"])
    return row


def summarize(rows: list[dict]) -> list[dict]:
    """Mean over repeats per (shape, arm, size), with the speedup and scaling efficiency over
    the same (shape, arm) on one GPU and the requests whose greedy tokens (first repeat) differ
    from it."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["repeat"] is not None:
            groups.setdefault((r["context"], r["batch"], r["arm"], r["size"]), []).append(r)
    out = []
    for (context, batch, arm, size), rs in groups.items():
        mean = sum(r["decode_tokens_per_s"] for r in rs) / len(rs)
        out.append(dict(context=context, batch=batch, arm=arm, size=size, decode_tokens_per_s=mean,
                        ms_per_step=sum(r["ms_per_step"] for r in rs) / len(rs), density=rs[-1]["density"],
                        roofline_share=mean / rs[-1]["roofline_tokens_per_s"]))
    for s in out:
        one = groups.get((s["context"], s["batch"], s["arm"], 1))
        if one is None:
            s.update(speedup=None, efficiency=None, differ=None)
            continue
        speedup = s["decode_tokens_per_s"] / (sum(r["decode_tokens_per_s"] for r in one) / len(one))
        mine = groups[(s["context"], s["batch"], s["arm"], s["size"])][0].get("tokens")
        differ = None if mine is None or one[0].get("tokens") is None else \
            speculative_arms.compare_tokens(one[0]["tokens"], mine)["differ"]
        s.update(speedup=speedup, efficiency=speedup / s["size"], differ=differ)
    return out


def markdown(report: dict) -> str:
    env, a = report.get("environment") or {}, report["args"]
    fmt = rp.fmt
    lines = [f"# Tensor-parallel decode scaling ({report['date']})", "",
             f"{env.get('device', '?')} x {max(a['tensor_parallel_size'])}; torch {env.get('torch', '?')}; model "
             f"{report['model']}; {a['dtype']}; {a['new_tokens']} new tokens per request, {a['repeats']} repeats "
             f"after a {a['warmup_tokens']}-token warm-up; per-GPU roofline at {a['hbm_tbps']} TB/s.", "",
             "speedup: decode tok/s over the same arm on one GPU; efficiency: speedup / GPUs; differ: requests "
             "whose greedy tokens differ from that arm's on one GPU.", "",
             "| ctx x batch | arm | GPUs | decode tok/s | ms/step | share of per-GPU roofline | speedup | "
             "efficiency | density | differ |", "|" + "---|" * 10]
    for s in report["summary"]:
        lines.append(f"| {s['context']} x {s['batch']} | {s['arm']} | {s['size']} | {s['decode_tokens_per_s']:.1f} | "
                     f"{s['ms_per_step']:.2f} | {s['roofline_share']:.0%} | {fmt(s['speedup'], '.2f')} | "
                     f"{fmt(s['efficiency'], '.0%')} | {decode_report.density_text(s['density'])} | {fmt(s['differ'], 'd')} |")
    lines += ["", "## Every run", "", "| ctx x batch | arm | GPUs | repeat | decode tok/s | ms/step | prefill s | "
              "fallbacks | preemptions | status |", "|" + "---|" * 10]
    for r in report["rows"]:
        head = f"| {r['context']} x {r['batch']} | {r['arm']} | {r['size']} |"
        if r["repeat"] is None:
            lines.append(f"{head} | | | | | | {r['status'][:300]} |")
            continue
        lines.append(f"{head} {r['repeat'] + 1} | {r['decode_tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | "
                     f"{fmt(r['prefill_s'], '.2f')} | {fmt(r['fallbacks'], 'd')} | {fmt(r['preemptions'], 'd')} | ok |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path) -> str:
    """tp_scaling.json and .md in out; the markdown."""
    return rp.write_report(out, "tp_scaling", report, markdown(report))


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    scales = check_args(parser, args)
    workdir = Path(tempfile.mkdtemp(prefix="wise-tp-scaling-"))
    try:
        config, checkpoint, recipe = workload.prepare_model(args)
        report = dict(date=rp.now(), host=platform.node(),
                      model=args.model or f"random {args.preset} (std {args.std}, seed 0)",
                      config=dataclasses.asdict(config),
                      args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                      environment=None, rows=[], summary=[])
        for (context, batch), q_scale in zip(args.shapes, scales):
            num_pages = workload.cohort_pages(context, batch, args.new_tokens, args.page_size) + 1
            for arm in args.arms:
                for size in args.tensor_parallel_size:
                    spec = dict(arm=arm, context=context, batch=batch, q_scale=q_scale, checkpoint=checkpoint,
                                random=recipe, std=args.std, seed=0, dtype=args.dtype, device=args.device,
                                kernel=args.kernel, eta=args.eta, page_size=args.page_size, num_pages=num_pages,
                                cuda_graphs=args.cuda_graphs, max_num_batched_tokens=args.max_num_batched_tokens,
                                new_tokens=args.new_tokens, warmup_tokens=args.warmup_tokens, repeats=args.repeats,
                                tensor_parallel_size=size, old_src=None)
                    run_dir = workdir / f"tp{size}"   # run_worker names its files by shape and arm
                    run_dir.mkdir(exist_ok=True)
                    result = throughput.run_worker(spec, args.child_timeout, run_dir)
                    report["environment"] = report["environment"] or result.get("environment")
                    if result["status"] != "ok":
                        report["rows"].append(row_of(spec, result, None, config, args))
                    for i in range(len(result.get("repeats", ()))):
                        report["rows"].append(row_of(spec, result, i, config, args))
                    last = report["rows"][-1]
                    print(f"{context:>6} x {batch:<4} {arm:>6} tp{size} "
                          + (f"{last['decode_tokens_per_s']:.1f} tok/s, {last['ms_per_step']:.2f} ms/step"
                             if last["repeat"] is not None else last["status"][:300]), flush=True)
                    report["summary"] = summarize(report["rows"])
                    write_report(report, args.out)   # after every run: a run cut short still leaves a report
        print(markdown(report))
        return report
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
