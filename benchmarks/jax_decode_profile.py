"""Where a JAX decode step's time goes: the serving engine's steps under the profiler.

    python benchmarks/jax_decode_profile.py --shapes 1024x64,1024x1 --q-scale 8 \\
        --arms dense,dense+stacked --out DIR                                      # on an H200
    python benchmarks/jax_decode_profile.py --preset test-tiny --dtype float32 --kernel reference \\
        --shapes 64x2 --arms dense --out /tmp/jp                                     # CPU smoke

Each (shape, arm) runs in a fresh process (arms and workloads as in jax_generate_bench.py, whose
setup it uses): one warm-up request compiles the prefill, a cohort of C requests of L tokens is
admitted, two untimed decode steps compile its step (its batch and context buckets), then
--steps decode steps are timed on the host and --steps more run under
`jax.profiler` (perfetto trace). Device activity is summed per trace line and per kernel name,
and kernels are grouped (GEMM, decode attention, copies and scatters, other fusions, other); `busy` is the summed
kernel time per step, `span` the first-to-last kernel time per step, so span - busy is idle
device time. --dump-hlo keeps the optimised HLO of the decode step. Writes
jax_decode_profile.json and .md to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
sys.path[:0] = [p for p in (str(_ROOT), str(_HERE)) if p not in sys.path]

import jax_generate_bench as bench  # noqa: E402
from device_trace import device_activity  # noqa: E402
from throughput import cohort_pages, parse_floats, parse_shapes  # noqa: E402

def worker(spec: dict) -> dict:
    import jax
    import wise_jax
    from wise_core.config import WiseConfig
    from wise_jax.params import split_projections
    config, params, prompts = bench._setup(spec)
    mode, options = bench.parse_arm(spec["arm"])
    if "unfused" in options:
        params = split_projections(config, params)
    wise_config = WiseConfig(eta=spec["eta"], kernel=spec["kernel"]) if mode == "wise" else None
    steps = spec["steps"]
    llm = wise_jax.LLM(params, config, wise_config=wise_config, num_pages=spec["num_pages"],
                       page_size=spec["page_size"], max_num_seqs=spec["batch"], kernel=spec["kernel"],
                       max_model_len=spec["context"] + 2 * steps + 8, unroll=True if "unroll" in options else 1,
                       layers="stacked" if "stacked" in options else "unstacked")
    start = time.perf_counter()
    llm.generate(prompts[:1], wise_jax.SamplingParams(max_tokens=4, ignore_eos=True))
    warmup_s = time.perf_counter() - start
    for p in prompts:
        llm.add_request(p, wise_jax.SamplingParams(max_tokens=2 * steps + 6, ignore_eos=True))
    while llm._waiting:                       # admissions (prefills) until the whole cohort runs
        llm.step()
    for _ in range(2):
        llm.step()
    jax.block_until_ready(llm.cache)
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    jax.block_until_ready(llm.cache)
    host_ms = 1e3 * (time.perf_counter() - start) / steps
    trace_dir = Path(spec["trace_dir"])
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(steps):
            llm.step()
        jax.block_until_ready(llm.cache)
    activity = device_activity(trace_dir, steps)
    return dict(status="ok", environment=f"jax {jax.__version__}; {jax.devices()[0].device_kind}",
                warmup_s=warmup_s, ms_per_step=host_ms, **activity)


def run(spec: dict, workdir: Path, timeout: float, hlo_dir: Path | None) -> dict:
    name = f"{spec['context']}x{spec['batch']}-{spec['arm']}"
    spec = dict(spec, result=str(workdir / f"{name}.json"), trace_dir=str(workdir / f"{name}-trace"))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    dump = None if hlo_dir is None else workdir / f"{name}-hlo"
    dump_flags = () if dump is None else (f"--xla_dump_to={dump}", "--xla_dump_hlo_module_re=.*_step.*")
    done = bench.spawn(Path(__file__), spec_path, bench.arm_env(spec["arm"], dump_flags), timeout)
    if isinstance(done, dict):
        return done
    if dump is not None and dump.exists():
        hlo_dir.mkdir(parents=True, exist_ok=True)
        for f in dump.glob("*after_optimizations.txt"):
            with open(f, "rb") as src, gzip.open(hlo_dir / f"{name}.{f.name}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    if done.returncode != 0 or not Path(spec["result"]).exists():
        return dict(status=f"error: worker exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    return json.loads(Path(spec["result"]).read_text())


def markdown(report: dict) -> str:
    out = [f"# JAX decode-step profile ({report['date']})", "", report["environment"], ""]
    for r in report["runs"]:
        out += [f"## {r['context']} x {r['batch']}, {r['arm']} (q-scale {r['q_scale']})", ""]
        if r["status"] != "ok":
            out += [f"`{r['status']}`", ""]
            continue
        busy, span = r["busy_us"], r["span_us"]
        out += [f"host-timed step {r['ms_per_step']:.2f} ms; profiled: kernels busy "
                f"{(busy or 0) / 1e3:.2f} ms, span {(span or 0) / 1e3:.2f} ms per step", "",
                "| group | calls / step | ms / step |", "|---|---|---|"]
        out += [f"| {g} | {v['calls_per_step']:.0f} | {v['us_per_step'] / 1e3:.3f} |"
                for g, v in sorted(r["groups"].items(), key=lambda kv: -kv[1]["us_per_step"])]
        out += ["", "| trace line | events / step | busy ms / step |", "|---|---|---|"]
        out += [f"| {k} | {v['events_per_step']:.0f} | {v['busy_us'] / 1e3:.3f} |" for k, v in r["lines"].items()]
        out += ["", "| kernel (top 40) | calls / step | us / step |", "|---|---|---|"]
        out += [f"| `{k[:90]}` | {v['calls_per_step']:.1f} | {v['us_per_step']:.1f} |" for k, v in r["kernels"].items()]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--q-scale", type=parse_floats, default=[8.0], help="one value, or one per shape")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1024x64,1024x1"))
    p.add_argument("--arms", type=bench.parse_arms, default=["dense", "wise"])
    p.add_argument("--steps", type=int, default=4, help="decode steps timed, then as many profiled")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--kernel", default="auto", choices=("auto", "pallas", "reference"))
    p.add_argument("--eta", type=float, default=0.95)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--child-timeout", type=float, default=300)
    p.add_argument("--dump-hlo", action="store_true", help="keep the decode step's optimised HLO (gzipped)")
    p.add_argument("--out", type=Path, default=_HERE / "results")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        try:
            result = worker(spec)
        except Exception as e:  # reported in the run; the others go on
            import traceback
            traceback.print_exc()
            result = dict(status=f"error: {type(e).__name__}: {e}"[:800])
        Path(spec["result"]).write_text(json.dumps(result))
        return result
    from wise_core.config import PRESETS
    config = dataclasses.replace(PRESETS[args.preset], eos_token_id=None)
    scales = args.q_scale * len(args.shapes) if len(args.q_scale) == 1 else args.q_scale
    if len(scales) != len(args.shapes):
        p.error(f"--q-scale gives {len(args.q_scale)} values for {len(args.shapes)} shapes")
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="wise-jax-profile-"))
    report = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S"), args={k: str(v) for k, v in vars(args).items()},
                  environment="", runs=[])
    try:
        for (context, batch), q_scale in zip(args.shapes, scales):
            for arm in args.arms:
                spec = dict(arm=arm, context=context, batch=batch, q_scale=q_scale,
                            config=dataclasses.asdict(config), std=args.std, seed=0, dtype=args.dtype,
                            kernel=args.kernel, eta=args.eta, page_size=args.page_size, steps=args.steps,
                            num_pages=cohort_pages(context, batch, 2 * args.steps + 8, args.page_size) + 1)
                result = run(spec, workdir, args.child_timeout, args.out / "hlo" if args.dump_hlo else None)
                report["environment"] = report["environment"] or result.pop("environment", "")
                result.pop("environment", None)
                report["runs"].append(dict(context=context, batch=batch, arm=arm, q_scale=q_scale, **result))
                print(f"{context} x {batch} {arm}: {result['status']}"
                      + (f", {result['ms_per_step']:.2f} ms/step, busy {(result['busy_us'] or 0) / 1e3:.2f} ms"
                         if result["status"] == "ok" else ""), flush=True)
                (args.out / "jax_decode_profile.json").write_text(json.dumps(report, indent=1))
        (args.out / "jax_decode_profile.json").write_text(json.dumps(report, indent=1))
        (args.out / "jax_decode_profile.md").write_text(markdown(report))
        return report
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
