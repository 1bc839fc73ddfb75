"""Compile stalls of both serving engines with their constructor defaults: first token cold and warm, a shrinking batch.

    python -m benchmarks.engine.compile_stalls --out benchmarks/results/DIR          # on a GPU: ouro-1.4b, both engines
    bash benchmarks/gpu_suite.sh stalls OUTDIR                                       # the same in one ~9-minute slot
    python -m benchmarks.engine.compile_stalls --preset test-tiny --dtype float32 --context 48 --batch 3 \\
        --out /tmp/cs                                                                # CPU smoke

Issue 45's targets: a cold engine (empty compile cache) serves the first token of a 1K prompt
within 60 s and a warm one (cache filled) within 10 s; a workload whose batch shrinks from 64 to 1
one request at a time never stops for a compile (report the longest step).

Every engine (--engines, `wise_jax.LLM` and `wise_torch.LLM`) is built as a user builds it: the
model alone (random weights of --preset in --dtype, q_proj times --q-scale, drawn on the device:
`jax_generate_bench.cohort_setup`, `workload.random_model`), every other constructor argument at
its default (pool, max_num_seqs, max_model_len, kernel), but for the cache directory below. Each
measurement runs in a fresh process (this module with --worker), in this order:

1. cold: an empty persistent cache. JAX: `LLM(..., compilation_cache=DIR)` (jax's persistent
   compilation cache, `wise_jax.engine.llm.use_compilation_cache`; jax's thresholds for what it
   keeps at their defaults). Torch keeps no compiled programs across processes (its CUDA graphs
   are captured again at every start); what it does keep is Triton's kernel cache, so its cold
   process gets an empty TRITON_CACHE_DIR. Timed: from just before the LLM constructor to the
   first token of one --context-token prompt (max_tokens=1), split into the constructor's seconds
   and the first request's (add_request, then `step` until the token is read). Then the JAX
   process waits for the rest of its start-up set (`llm.wait_compiles()`: on a GPU the engine
   compiles it in the background; "rest of start-up s"), so the warm process finds it cached.
   Reported with `llm.stats()`' program counts (step_programs, step_build_s, larger_bucket_steps,
   compile_blocked_steps, compile_blocked_s) and the files in the cache directory.
2. warm: a second fresh process on the same (now filled) cache directory, timed the same way.
   Torch's runs only where its cold process left Triton kernels in the cache; where it compiled
   none (a CPU: its reference kernels) a warm start is a cold one, and the report says so.
3. shrinking: --batch requests of --context tokens submitted together, request i with
   max_tokens = i + 1 (ignore_eos), so that once they all decode the batch shrinks by one each
   step. The engine is built on the warm cache and its start-up set compiled first (JAX:
   `wait_compiles`, "start s"); the decode buckets are not warmed up. Every `llm.step()` is timed
   from the first one (a step returns once it has read the tokens of the step before it, which the
   device ran meanwhile). Reported: the longest step (its index, what it launched, the requests
   running after it), the median, the steps slower than 3x the median, and the stats' program
   counts over the workload. A step stopped for a compile if it waited for a step program: JAX's
   compile_blocked_steps; torch builds its programs (CUDA graphs; none on a CPU, which runs eager)
   on the step path, so every graph made during the workload stopped one step.
Every process's log is searched for XLA's warnings that a program did not fit its memory and is
rematerialized ("remat warnings": such a program compiles longer).

Writes compile_stalls.json and compile_stalls.md to --out (after every measurement, so a run cut
short still leaves a report), with the device, versions and date, and every target marked met or
not met with its number. On a CPU the JAX engine compiles on the step path (no background
compiles: `LLM(background_compile=None)` turns them on on a GPU only), so its blocked steps there
are expected; the targets are the GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import report as rp
from benchmarks.engine.workload import parse_floats

STEM = "compile_stalls"
ENGINES = ("jax", "torch")
MEASUREMENTS = ("cold", "warm", "shrinking")
COLD_FIRST_TOKEN_S = 60.0      # the targets
WARM_FIRST_TOKEN_S = 10.0
# Torch's warm process runs only where its cold one left Triton kernels in the cache.
WARM_IS_COLD = ("not run: the cold process compiled no Triton kernel (its cache is empty), so a warm start is "
                "a cold one")
SLOW_STEP = 3.0                # a step slower than this many times the median is counted
PROGRAM_STATS = ("step_programs", "step_build_s", "larger_bucket_steps", "compile_blocked_steps", "compile_blocked_s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="jax,torch", help=f"comma-separated, of {ENGINES}")
    p.add_argument("--preset", default="ouro-1.4b", help="model shape for random weights (wise_core PRESETS)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--std", type=float, default=0.02, help="std of the random weights")
    p.add_argument("--q-scale", type=parse_floats, default=[8.0], help="q_proj multiplier (8: the 1K calibration)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of every request")
    p.add_argument("--batch", type=int, default=64, help="requests of the shrinking workload")
    p.add_argument("--child-timeout", type=float, default=600, help="seconds per measurement's process")
    p.add_argument("--out", type=Path, default=rp.RESULTS)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one measurement from a JSON spec file
    return p


# -- workers (one process per (engine, measurement)) -------------------------------------------------------
def _jax_engine(spec: dict):
    """(a function building the engine with its defaults (`build_engine`), SamplingParams, the prompts)."""
    from benchmarks.engine.jax_generate_bench import cohort_setup
    from wise_core.sampling_params import SamplingParams
    from wise_serve.model import build_engine
    config, params, prompts = cohort_setup(spec)
    build = lambda: build_engine("jax", params, config=config, compilation_cache=spec["cache"])  # noqa: E731
    return build, SamplingParams, prompts


def _torch_engine(spec: dict):
    """As `_jax_engine`; the Triton kernel cache is the process's TRITON_CACHE_DIR (`run_child`)."""
    import torch
    from benchmarks.engine.workload import random_model, random_prompts
    from wise_core.model_config import ModelConfig
    from wise_core.sampling_params import SamplingParams
    from wise_serve.model import build_engine
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(dict(spec, device=device), ModelConfig(**spec["config"]))
    return (lambda: build_engine("torch", model)), SamplingParams, random_prompts(spec, model.config.vocab_size)


def _program_stats(llm) -> dict:
    stats = llm.stats()
    return {name: getattr(stats, name) for name in PROGRAM_STATS}


def _first_token(spec: dict, make, sampling, prompts, save) -> dict:
    """Build the engine and serve one prompt's first token; JAX then waits for its start-up set."""
    start = time.perf_counter()
    llm = make()
    built = time.perf_counter()
    request = llm.add_request(prompts[0], sampling(max_tokens=1))
    while not any(out.request_id == request and out.token_ids for out in llm.step()):
        if not llm.has_unfinished():
            raise RuntimeError("the request finished without a token")
    done = time.perf_counter()
    result = dict(status="ok", constructor_s=built - start, first_request_s=done - built, first_token_s=done - start,
                  pool_sizing=llm.stats().pool_sizing, **_program_stats(llm))
    if spec["engine"] == "jax":
        result["background_compile"] = llm.programs.background
    save(result)    # a process cut short in the start-up compiles below still reports its first token
    if spec["engine"] == "jax":
        llm.wait_compiles()
        result.update(startup_rest_s=time.perf_counter() - done, **_program_stats(llm))
    return result


def _shrinking(spec: dict, make, sampling, prompts, save) -> dict:
    """--batch requests, request i with max_tokens i + 1; every step timed after the start-up set."""
    start = time.perf_counter()
    llm = make()
    extra = {}
    if spec["engine"] == "jax":
        llm.wait_compiles()
        extra["background_compile"] = llm.programs.background
    before = _program_stats(llm)
    wanted = {llm.add_request(p, sampling(max_tokens=i + 1, ignore_eos=True)): i + 1 for i, p in enumerate(prompts)}
    tokens = dict.fromkeys(wanted, 0)
    steps = []
    started = time.perf_counter()
    while llm.has_unfinished():
        step_start = time.perf_counter()
        outputs = llm.step()
        seconds = time.perf_counter() - step_start
        for out in outputs:
            tokens[out.request_id] = len(out.token_ids)
        steps.append(dict(seconds=seconds, launched=llm.inflight_kind, running=len(llm.scheduler.running),
                          tokens_read=len(outputs)))
    workload_s = time.perf_counter() - started
    wrong = {rid: n for rid, n in tokens.items() if n != wanted[rid]}
    if wrong:
        raise RuntimeError(f"requests ended with token counts {wrong} (request id: tokens), not max_tokens")
    after = _program_stats(llm)
    llm.close()   # JAX: drop the compiles still queued (exact buckets), which the exit would wait for
    return dict(status="ok", start_s=started - start, workload_s=workload_s, steps=steps, **extra,
                programs_before=before, programs_after=after,
                during={name: after[name] - before[name] for name in PROGRAM_STATS},
                pool_sizing=llm.stats().pool_sizing)


def worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result_path = Path(spec["result"])

    def save(result: dict) -> None:
        result_path.write_text(json.dumps(result, default=str))

    try:
        setup_start = time.perf_counter()
        make, sampling, prompts = (_jax_engine if spec["engine"] == "jax" else _torch_engine)(spec)
        setup_s = time.perf_counter() - setup_start
        environment = rp.environment(spec["engine"])
        measure = _shrinking if spec["measurement"] == "shrinking" else _first_token
        result = measure(spec, make, sampling, prompts,
                         lambda partial: save(dict(partial, setup_s=setup_s, environment=environment)))
        result.update(setup_s=setup_s, environment=environment)
    except Exception as e:  # reported in the row; the other measurements go on
        traceback.print_exc()
        result = dict(status=f"error: {type(e).__name__}: {e}"[:800])
    save(result)


def run_child(spec: dict, timeout: float, workdir: Path) -> dict:
    """One (engine, measurement) in a fresh process -> its result (a partial one, or why there is none,
    with status saying so)."""
    name = f"{spec['engine']}-{spec['measurement']}"
    spec = dict(spec, result=str(workdir / f"{name}.result.json"))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = rp.module_env(PYTHONUNBUFFERED="1", **({"TRITON_CACHE_DIR": spec["cache"]} if spec["engine"] == "torch"
                                                 else {}))
    result_path = Path(spec["result"])
    try:
        done = subprocess.run(rp.module_command("engine.compile_stalls", "--worker", str(spec_path)), env=env,
                              timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:   # its output so far: bytes on POSIX whatever text= says
        log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x)
        partial = json.loads(result_path.read_text()) if result_path.exists() else {}
        return dict(partial, remat_warnings=remat_warnings(log), log_tail=log[-1500:],
                    status=f"timed out after {timeout:.0f} s"
                    + (" (after its first token, waiting for the start-up compiles)" if partial else ""))
    log = (done.stdout + done.stderr).strip()
    if done.returncode != 0 or not result_path.exists():
        return dict(status=f"error: worker exited {done.returncode}: {log[-600:]}")
    result = json.loads(result_path.read_text())
    result["remat_warnings"] = remat_warnings(log)
    if result["status"] != "ok" and log:
        result["log_tail"] = log[-1500:]
    return result


def remat_warnings(log: str) -> int:
    """XLA's warnings that a program did not fit its memory limit (it rematerializes, compiling longer)."""
    return sum("by rematerialization" in line for line in log.splitlines())


def cache_files(cache: Path) -> int:
    """Files under a cache directory (0 where it does not exist)."""
    return sum(1 for f in cache.rglob("*") if f.is_file()) if cache.exists() else 0


# -- the report ----------------------------------------------------------------------------------------------
def shrinking_summary(result: dict) -> dict:
    """The shrinking workload's steps: the longest (index, what it launched, requests running after
    it), the median, the steps slower than SLOW_STEP x the median, and the steps that stopped for a
    step program (JAX: compile_blocked_steps; torch: the programs, CUDA graphs, made on its steps)."""
    steps = result["steps"]
    seconds = [s["seconds"] for s in steps]
    median = statistics.median(seconds)
    longest = max(range(len(steps)), key=seconds.__getitem__)
    during = result["during"]
    stalls = during["compile_blocked_steps"] if result["engine"] == "jax" else during["step_programs"]
    return dict(steps=len(steps), median_s=median, longest_s=seconds[longest], longest_step=longest,
                longest_launched=steps[longest]["launched"], longest_running=steps[longest]["running"],
                slow_steps=sum(s > SLOW_STEP * median for s in seconds), compile_stalls=stalls)


def standing(report: dict) -> list[dict]:
    """Each engine's three targets: the measured number and whether it is met (None: not measured)."""
    out = []
    context, batch = report["args"]["context"], report["args"]["batch"]
    for engine in report["engines"]:
        results = report["results"].get(engine, {})
        for measurement, bound in (("cold", COLD_FIRST_TOKEN_S), ("warm", WARM_FIRST_TOKEN_S)):
            r = results.get(measurement, {})
            warm_is_cold = r.get("status") == WARM_IS_COLD
            value = (results["cold"] if warm_is_cold else r).get("first_token_s")
            out.append(dict(engine=engine, target=f"{measurement} start: first token of a {context}-token prompt "
                                                  f"<= {bound:g} s",
                            value=value, unit="s", met=None if value is None else value <= bound,
                            status=r.get("status", "not run"),
                            note="its cold start: nothing was cached" if warm_is_cold else None))
        r = results.get("shrinking", {})
        summary = r.get("summary")
        stalls = None if summary is None else summary["compile_stalls"]
        out.append(dict(engine=engine, target=f"batch shrinking from {batch} to 1: no step stops for a compile",
                        value=stalls, unit="steps", met=None if stalls is None else stalls == 0,
                        status=r.get("status", "not run"),
                        note=None if summary is None else f"longest step {1e3 * summary['longest_s']:.1f} ms"))
    return out


def _environment_line(report: dict) -> str:
    parts = []
    for engine, env in report["environment"].items():
        if engine == "jax":
            parts.append(f"jax {env['jax']}, jaxlib {env['jaxlib']} on {env['device']}")
        else:
            parts.append(f"torch {env['torch']}, triton {env['triton']}, cuda {env['cuda']} on {env['device']}")
    some = next(iter(report["environment"].values()), None)
    host = f"{some['host']}, python {some['python']}, {some['cpu_count']} cpus; " if some else ""
    return host + "; ".join(parts)


def _first_token_rows(report: dict) -> list[list]:
    rows = []
    for engine in report["engines"]:
        for measurement in ("cold", "warm"):
            r = report["results"].get(engine, {}).get(measurement)
            if r is not None:
                rows.append([engine, measurement] + [rp.fmt(r.get(key), spec) for key, spec in (
                    ("constructor_s", ".2f"), ("first_request_s", ".2f"), ("first_token_s", ".2f"),
                    ("startup_rest_s", ".2f"), ("step_programs", "d"), ("step_build_s", ".2f"),
                    ("larger_bucket_steps", "d"), ("compile_blocked_steps", "d"), ("compile_blocked_s", ".2f"),
                    ("cache_files", "d"), ("remat_warnings", "d"))] + [r["status"]])
    return rows


def _shrinking_rows(report: dict) -> tuple[list[list], list[list]]:
    """The shrinking workload's row per engine, and the five longest steps of each."""
    rows, longest = [], []
    for engine in report["engines"]:
        r = report["results"].get(engine, {}).get("shrinking")
        if r is None:
            continue
        s, during = r.get("summary"), r.get("during", {})
        cells = ["-"] * 4 if s is None else [
            s["steps"], f"{1e3 * s['median_s']:.1f}",
            f"{1e3 * s['longest_s']:.1f} (step {s['longest_step']}, {s['longest_launched'] or 'nothing'}, "
            f"{s['longest_running']} running)", s["slow_steps"]]
        rows.append([engine, rp.fmt(r.get("start_s"), ".2f"), rp.fmt(r.get("workload_s"), ".2f")] + cells
                    + [rp.fmt(during.get(key), spec) for key, spec in (
                        ("step_programs", "d"), ("step_build_s", ".2f"), ("larger_bucket_steps", "d"),
                        ("compile_blocked_steps", "d"), ("compile_blocked_s", ".2f"))]
                    + ["-" if s is None else s["compile_stalls"], rp.fmt(r.get("remat_warnings"), "d"), r["status"]])
        steps = r.get("steps", [])
        for i in sorted(range(len(steps)), key=lambda i: -steps[i]["seconds"])[:5]:
            longest.append([engine, i, steps[i]["launched"] or "nothing", steps[i]["running"], steps[i]["tokens_read"],
                            f"{1e3 * steps[i]['seconds']:.1f}"])
    return rows, longest


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [f"# Compile stalls with the constructor defaults ({report['date']})", "",
             f"{_environment_line(report)}. Model: random {a['preset']} weights ({a['dtype']}, std {a['std']:g}, "
             f"q_proj x{a['q_scale'][0]:g}), every other constructor argument at its default; each measurement a "
             "fresh process. Cold: an empty cache directory (JAX: `compilation_cache=DIR`; torch: an empty "
             "TRITON_CACHE_DIR, Triton's kernel cache, the one thing torch keeps across processes: its CUDA graphs "
             "are captured again at every start); warm: the same directory, filled by the cold process (torch's "
             "runs only where the cold one left Triton kernels there). Remat warnings: XLA's warnings that a "
             "program did not fit its memory (it compiles longer).", "",
             f"## First token of one {a['context']}-token prompt", "",
             "Seconds from just before the LLM constructor; rest of start-up: JAX's `wait_compiles()` after the "
             "first token (its start-up set, compiled in the background on a GPU); program counts after it "
             "(step programs and build s: decode's).", ""]
    lines += rp.table(["engine", "start", "constructor s", "first request s", "first token s", "rest of start-up s",
                       "step programs", "build s", "larger-bucket steps", "blocked steps", "blocked s", "cache files",
                       "remat warnings", "status"], _first_token_rows(report))
    rows, longest = _shrinking_rows(report)
    lines += ["", f"## A batch shrinking from {a['batch']} to 1", "",
              f"{a['batch']} requests of {a['context']} tokens submitted together, request i with max_tokens i + 1 "
              "(ignore_eos); every `step()` timed after the start-up set (JAX: `wait_compiles()`, in start s), the "
              "decode buckets not warmed up. Program counts over the workload (decode programs: JAX's compiled "
              "steps, torch's CUDA graphs); stalls: steps that stopped for a step program (JAX: "
              "compile_blocked_steps; torch: the CUDA graphs made, each captured on a step). Slow: steps over "
              f"{SLOW_STEP:g}x the median.", ""]
    lines += rp.table(["engine", "start s", "workload s", "steps", "median ms", "longest ms", "slow",
                       "decode programs made", "their build s", "larger-bucket steps", "blocked steps", "blocked s",
                       "stalls", "remat warnings", "status"], rows)
    if longest:
        lines += ["", "The five longest steps of each engine (launched: what the step launched; running: requests "
                  "decoding after it; read: the tokens it read, of the step before):", ""]
        lines += rp.table(["engine", "step", "launched", "running", "read", "ms"], longest)
    lines += ["", "## Targets", ""]
    if any(r.get("background_compile") is False for r in report["results"].get("jax", {}).values()):
        lines += ["The JAX engine compiled on the step path here (no background compiles: the default on a CPU), so "
                  "its blocked steps are expected; the targets are the GPU's.", ""]
    met = {True: "met", False: "not met"}
    lines += rp.table(["engine", "target", "measured", "met"], [
        [t["engine"], t["target"], rp.fmt(t["value"], ".2f" if t["unit"] == "s" else "d") + f" {t['unit']}"
         + (f" ({t['note']})" if t["note"] else ""), met.get(t["met"], f"not measured ({t['status']})")]
        for t in report["standing"]])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return None
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or set(engines) - set(ENGINES) or len(set(engines)) != len(engines):
        parser.error(f"--engines takes distinct names of {ENGINES}, got {args.engines!r}")
    if len(args.q_scale) != 1:
        parser.error("--q-scale takes one value (one context)")
    if args.context < 1 or args.batch < 1:
        parser.error("--context and --batch must be positive")
    from wise_core.presets import PRESETS
    if args.preset not in PRESETS:
        raise SystemExit(f"unknown --preset {args.preset!r}; one of {sorted(PRESETS)}")
    config = dataclasses.replace(PRESETS[args.preset], eos_token_id=None)
    workdir = Path(tempfile.mkdtemp(prefix="wise-compile-stalls-"))
    report = dict(date=rp.now(), engines=engines, args={k: (str(v) if isinstance(v, Path) else v)
                                                        for k, v in vars(args).items() if k != "worker"},
                  config=dataclasses.asdict(config), environment={}, results={}, standing=[])
    try:
        for engine in engines:
            cache = workdir / f"{engine}-cache"
            for measurement in MEASUREMENTS:
                batch = args.batch if measurement == "shrinking" else 1
                spec = dict(engine=engine, measurement=measurement, config=dataclasses.asdict(config),
                            context=args.context, batch=batch, dtype=args.dtype, std=args.std,
                            seed=0, q_scale=args.q_scale[0], cache=str(cache))
                cold = report["results"].get(engine, {}).get("cold", {})
                if engine == "torch" and measurement == "warm" and cold.get("status") == "ok" \
                        and not cold["cache_files"]:
                    result = dict(status=WARM_IS_COLD)
                else:
                    result = run_child(spec, args.child_timeout, workdir)
                result["engine"] = engine
                if measurement == "shrinking":
                    if "steps" in result:
                        result["summary"] = shrinking_summary(result)
                elif result["status"] != WARM_IS_COLD:
                    result["cache_files"] = cache_files(cache)
                if "environment" in result:
                    report["environment"].setdefault(engine, result.pop("environment"))
                report["results"].setdefault(engine, {})[measurement] = result
                report["standing"] = standing(report)
                rp.write_report(args.out, STEM, report, markdown(report))  # after each: a run cut short still reports
                print(f"{engine} {measurement}: {result['status'][:300]}"
                      + (f", first token {result['first_token_s']:.2f} s" if "first_token_s" in result else "")
                      + (f", longest step {1e3 * result['summary']['longest_s']:.1f} ms, "
                         f"{result['summary']['compile_stalls']} compile stalls" if "summary" in result else ""),
                      flush=True)
        print(markdown(report))
        return report
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
