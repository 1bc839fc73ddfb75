"""Decode throughput of the JAX serving engine (wise_jax.LLM): dense, WISE, their variants, and prefill.

    python -m benchmarks.engine.jax_generate_bench --shapes 1024x64,4096x20,8192x10,1024x1 --q-scale 8,7.3,7,8 \\
        --prefill-shapes 32768x2 --out benchmarks/results/DIR                           # on an H200
    python -m benchmarks.engine.jax_generate_bench --preset test-tiny --dtype float32 --kernel reference \\
        --shapes 64x3 --new-tokens 6 --arms dense,wise --out /tmp/jb                    # CPU smoke
    python -m benchmarks.engine.jax_generate_bench --preset huginn-0125 --num-steps 32 --kernel reference \\
        --shapes 1024x32,4096x8 --q-scale 3.1,2.83 --arms dense,wise,adaptive --out DIR # Huginn, on an H200

Method: `benchmarks.engine.throughput`'s (the reference system's), and its code where the job is the
same (`run_cohort`, the roofline, the targets): a cohort of C concurrent requests of exactly L
prompt tokens (random ids, seed fixed per shape), greedy, N output tokens each with ignore_eos;
decode throughput counts the tokens generated after the step in which the whole cohort has its
first token, over the time from that step to the last. Each (shape, arm) runs in a fresh process
(this module with --worker) with the same KV pool (the cohort's pages + 1), after one untimed
warm-up cohort of --warmup-tokens new tokens (it compiles the cohort's programs: its prefill,
and the decode step at the cohort's batch bucket and context bucket), then --repeats timed
cohorts, all printed. Compiled
programs go to a persistent compilation cache shared by the run's workers (--compile-cache), so
arms that share a program (the prefill of a context) compile it once; `recompiles` counts
traces during the timed cohorts (0 expected).

Arms: MODE[+OPTION...], MODE dense or wise (WiseConfig(eta), attention_backend=--kernel), or adaptive / wise-adaptive
(Huginn only): dense's / wise's engine with per-token adaptive depth
(`adaptive_depth=AdaptiveDepth(threshold=--adaptive-threshold)`, as `benchmarks.engine.throughput`'s
adaptive arms: exited rows ride along, every iteration runs every row, the roofline is the
fixed-depth arm's; reported: the mean depth, `stats().mean_decode_depth`, and the tok/s over the
fixed-depth arm with the same options, "over fixed"). Every arm's greedy tokens are compared
with the dense arm's of the same options ("differ": requests whose tokens differ; the adaptive
arms' are the exits', so they may differ, not an error). Options, to measure what each part of
the decode step costs:
- stacked: the layers a scan over the stacked weights (an LLM subclass with layers =
  "stacked") instead of a Python loop over per-layer weights (the engine's default,
  params.unstack_layers);
- unroll: with stacked, the layer scan fully unrolled (LLM(unroll=True));
- straight: every loop of the decode step straight-line (an LLM subclass with scan_loops =
  False) instead of a scan over each run of loops of one role (the engine's default);
- unfused: q/k/v and gate/up as separate GEMMs (params.split_projections) instead of fused;
- nocb: XLA_FLAGS --xla_gpu_enable_command_buffer= (no CUDA-graph command buffers);
- cbloops: XLA_FLAGS --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL (loops in command buffers);
- dsfusion: XLA_FLAGS --xla_gpu_enable_dynamic_slice_fusion=true (with stacked: lets GEMMs read
  a layer's slice of the stacked weights in place where XLA can);
- cublas: XLA_FLAGS --xla_gpu_enable_triton_gemm=false (every GEMM on cuBLAS, none as an XLA Triton
  GEMM fusion);
- noremat: XLA_FLAGS --xla_disable_hlo_passes=rematerialization (no rematerialization pass: on an H100
  its estimate of a decode program's memory (90-114 GiB) far exceeded the buffers it assigned (the pool,
  aliased in place, and 0.05 GiB of temporaries): it warned and added rematerialized copies of the K/V
  scatters; measured against the default to see what the pass costs or saves);
- tp2: the heads split over two devices (LLM(mesh=wise_jax.make_mesh(2))); its "over base" is
  the speedup over one device.
Arms old, old-wise: the pre-engine `wise_jax.generate` (dense / WISE) of --old-commit, run from a
source tree of it (--old-src DIR holding its wise_core and wise_jax, e.g. `git archive COMMIT
wise_core wise_jax | tar -x -C DIR`); timed by its own stats after a warm-up call.
--prefill-shapes LxC: the cohort's prefill alone (C requests of L tokens, dense, 2 new tokens).

Workloads: random weights at a preset's shape (Ouro: wise_jax.init_params, normal(0, --std), bf16
by default, drawn on the device), q_proj multiplied by --q-scale (one value or one per shape) to
give peaked attention; the measured reuse-union density per reuse depth is reported. Writes
jax_generate_bench.json, .md (with the standing against the targets) and .png to --out.

Huginn (huginn-0125, test-tiny-huginn): `random_huginn_params` draws every HF tensor on the
device from its own key, fold_in(PRNGKey(seed), crc32(name)), as `workload.random_recipe` says
(`wise_core.checkpoint.random_init`; the queries times --q-scale: the q rows of attn.Wqkv and q's
half of attn.qk_bias), laid out there by `wise_jax.huginn.huginn_from_tensors`. The torch
benchmark draws the same recipe with torch's generator: the same distribution, not the same
values. --num-steps core iterations per token (default total_ut_steps); the wise arms use
`huginn_wise_config(num_steps)` (`arms.wise_config_of`), the report states the profile;
options that change Ouro's parameter layout or decode loops (stacked, unroll, straight, unfused,
tp2) and the old arms run Ouro only; a Huginn run is held to no target (the issue's are Ouro-1.4B's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import report as rp
from benchmarks.engine.speculative_arms import compare_tokens
from benchmarks.engine.arms import (ADAPTIVE_ARMS, adaptive_text, adaptive_threshold, base_of, check_depth,
                                    parse_threshold, prepare_old_src, wise_config_of, wise_profile)
from benchmarks.engine.decode_report import (density_text, engine_standing, mean_depth, plot, run_text, table,
                                             targets_section)
from benchmarks.engine.timing import roofline, run_cohort, stats_dict
from benchmarks.engine.workload import cohort_pages, config_fields, parse_floats, parse_shapes, random_recipe

# dense-default / wise-default: `LLM(params, config)` / `LLM(params, config, wise_config=WiseConfig())`
# (Huginn: num_steps=--num-steps, wise_config=huginn_wise_config(num_steps)), every other constructor
# argument at its default (pool, max_num_seqs, max_model_len, attention_backend).
MODES = ("dense", "wise", "dense-default", "wise-default", "old", "old-wise", "adaptive", "wise-adaptive")
OPTIONS = ("stacked", "unroll", "straight", "unfused", "nocb", "cbloops", "dsfusion", "cublas", "noremat", "tp2")
XLA_FLAGS = {"nocb": "--xla_gpu_enable_command_buffer=",
             "cbloops": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
             "dsfusion": "--xla_gpu_enable_dynamic_slice_fusion=true",
             "cublas": "--xla_gpu_enable_triton_gemm=false",
             "noremat": "--xla_disable_hlo_passes=rematerialization"}
OURO_LAYOUT = ("stacked", "unroll", "straight", "unfused", "tp2")   # Ouro only: its Params layout, decode loops, mesh
OLD_COMMIT = "bef25e92fbb27d035f3f9973f69047951c897363"  # the last commit before the serving engine
STEM = "jax_generate_bench"


def parse_arm(text: str) -> tuple[str, tuple[str, ...]]:
    mode, *options = text.strip().split("+")
    if mode not in MODES or any(o not in OPTIONS for o in options) or len(set(options)) != len(options):
        raise argparse.ArgumentTypeError(f"arm {text!r} is not MODE[+OPTION...] with MODE in {MODES} and "
                                         f"OPTIONs from {OPTIONS}")
    if mode.startswith("old") and options:
        raise argparse.ArgumentTypeError(f"arm {text!r}: the old path takes no options")
    if "unroll" in options and "stacked" not in options:
        raise argparse.ArgumentTypeError(f"arm {text!r}: unroll unrolls the scan of stacked layers (add +stacked)")
    return mode, tuple(options)


def parse_arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    for arm in arms:
        parse_arm(arm)
    if len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"arms repeat: {text!r}")
    return arms


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="ouro-1.4b", help="model shape for random weights (wise_core PRESETS)")
    p.add_argument("--layers", type=int, default=0, help="override the preset's num_hidden_layers (Ouro)")
    p.add_argument("--num-steps", type=int, help="a Huginn model's core iterations (default: total_ut_steps)")
    p.add_argument("--std", type=float, default=0.02, help="std of the random weights")
    p.add_argument("--q-scale", type=parse_floats, default=[1.0],
                   help="query multiplier: one value, or one per shape (e.g. 8,7.3,7,8)")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1024x64,4096x20,8192x10,1024x1"),
                   help="CONTEXTxBATCH list: prompt tokens x concurrent requests")
    p.add_argument("--prefill-shapes", type=parse_shapes, default=[], help="CONTEXTxBATCH cohorts to prefill")
    p.add_argument("--new-tokens", type=int, default=32, help="output tokens per request (>= 2)")
    p.add_argument("--warmup-tokens", type=int, default=4, help="output tokens of the untimed warm-up cohort")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arms", type=parse_arms, default=["dense", "wise"])
    p.add_argument("--adaptive-threshold", type=parse_threshold, default=None,
                   help="KL exit threshold of the adaptive arms (default: AdaptiveDepth's, the released 1e-3)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--kernel", default="auto", choices=("auto", "pallas", "reference"),
                   help="the attention_backend of every engine arm (the decode kernel of the old ones)")
    p.add_argument("--eta", type=float, default=0.95)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--old-src", type=Path, help="source tree of --old-commit (wise_core, wise_jax)")
    p.add_argument("--old-commit", default=OLD_COMMIT, help="commit to extract with git when --old-src is not given")
    p.add_argument("--hbm-tbps", type=float, default=4.3, help="memory bandwidth of the roofline")
    p.add_argument("--child-timeout", type=float, default=600, help="seconds per (shape, arm) process")
    p.add_argument("--compile-cache", type=Path, help="persistent compilation cache (default: one per run)")
    p.add_argument("--out", type=Path, default=rp.RESULTS)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one (shape, arm) from a JSON spec file
    return p


def check_args(parser: argparse.ArgumentParser, args) -> list[float]:
    """Validate the combination; returns the q scale of each shape."""
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode is timed after every request's first token)")
    if args.warmup_tokens < 1 or args.repeats < 1:
        parser.error("--warmup-tokens and --repeats must be >= 1")
    if not 0 < args.eta <= 1:
        parser.error(f"--eta must be in (0, 1], got {args.eta}")
    if args.page_size < 1 or args.hbm_tbps <= 0:
        parser.error("--page-size and --hbm-tbps must be positive")
    scales = args.q_scale * len(args.shapes) if len(args.q_scale) == 1 else args.q_scale
    if len(scales) != len(args.shapes):
        parser.error(f"--q-scale gives {len(args.q_scale)} values for {len(args.shapes)} shapes (give 1 or one each)")
    return scales


# -- workers (one process per (shape, arm)) ---------------------------------------------------------------------
def random_huginn_params(config, seed: int, std: float, q_scale: float, dtype):
    """Random HuginnParams made on the default device: the HF tensors of `random_recipe(config)`,
    normal ones from fold_in(PRNGKey(seed), crc32(name)) times std, q rows times q_scale (in
    float32, then cast to dtype), laid out on the device by `huginn_from_tensors`."""
    import zlib
    import jax
    import jax.numpy as jnp
    from wise_jax.huginn import huginn_from_tensors
    key = jax.random.PRNGKey(seed)

    def draw(name, shape, init, q_rows):
        if init != "normal":
            return (jnp.ones if init == "ones" else jnp.zeros)(shape, dtype)
        t = std * jax.random.normal(jax.random.fold_in(key, zlib.crc32(name.encode())), shape, jnp.float32)
        return (t.at[:q_rows].multiply(q_scale) if q_rows else t).astype(dtype)

    return huginn_from_tensors(config, {name: draw(name, *entry) for name, entry in random_recipe(config).items()},
                               dtype)


def cohort_setup(spec: dict):
    """(config, params, prompts) of the spec: random weights drawn on the device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import wise_jax
    from wise_core.model_config import ModelConfig
    config = ModelConfig(**spec["config"])
    rng = np.random.default_rng(spec["context"] * 1000 + spec["batch"])
    prompts = rng.integers(0, config.vocab_size, (spec["batch"], spec["context"])).tolist()
    if config.architecture == "huginn":
        return config, random_huginn_params(config, spec["seed"], spec["std"], spec["q_scale"],
                                            jnp.dtype(spec["dtype"])), prompts
    params = wise_jax.init_params(config, jax.random.PRNGKey(spec["seed"]), dtype=jnp.dtype(spec["dtype"]),
                                  std=spec["std"])
    if spec["q_scale"] != 1.0:
        if hasattr(params.layers, "qkv_proj"):
            from wise_jax.params import scale_queries
            params = scale_queries(config, params, spec["q_scale"])
        else:  # the pre-engine layout
            layers = dataclasses.replace(params.layers, q_proj=params.layers.q_proj * spec["q_scale"])
            params = dataclasses.replace(params, layers=layers)
    return config, params, prompts


def _engine_worker(spec: dict) -> dict:
    import wise_jax
    from wise_jax.params import split_projections
    config, params, prompts = cohort_setup(spec)
    num_steps = spec.get("num_steps")   # None: the model's total_ut_steps
    steps = config.total_ut_steps if num_steps is None else num_steps
    mode, options = parse_arm(spec["arm"])
    if "unfused" in options:
        params = split_projections(config, params)
    mesh = {"mesh": wise_jax.make_mesh(2)} if "tp2" in options else {}
    # The engine's measurement hooks, class attributes a subclass sets (wise_jax.LLM's docstring).
    hooks = {**({"scan_loops": False} if "straight" in options else {}),
             **({"layers": "stacked"} if "stacked" in options else {})}
    engine = type("ArmLLM", (wise_jax.LLM,), hooks) if hooks else wise_jax.LLM
    if mode.endswith("-default"):
        llm = engine(params, config, num_steps=num_steps,
                           wise_config=wise_config_of(config, steps) if mode == "wise-default" else None, **mesh)
    else:
        wise_config = wise_config_of(config, steps, eta=spec["eta"]) \
            if mode in ("wise", "wise-adaptive") else None
        from wise_core.adaptive_depth import AdaptiveDepth
        adaptive = AdaptiveDepth(threshold=spec["adaptive_threshold"]) if mode in ADAPTIVE_ARMS else None
        llm = engine(params, config, wise_config=wise_config, num_steps=num_steps, adaptive_depth=adaptive,
                           num_pages=spec["num_pages"], page_size=spec["page_size"], max_num_seqs=spec["batch"],
                           attention_backend=spec["kernel"],
                           max_model_len=spec["context"] + max(spec["new_tokens"], spec["warmup_tokens"]),
                           unroll=True if "unroll" in options else 1, **mesh)

    def cohort(requests: list, tokens: int) -> dict:
        llm.reset_stats()
        before = wise_jax.trace_counts()
        result = run_cohort(llm, requests, wise_jax.SamplingParams(max_tokens=tokens, ignore_eos=True), tokens)
        after = wise_jax.trace_counts()
        stats = llm.stats()
        result.update(stats=stats_dict(stats), density=stats.density, fallbacks=stats.fallbacks,
                      preemptions=stats.preemptions,
                      mean_depth=stats.mean_decode_depth if mode in ADAPTIVE_ARMS else None,
                      pages_returned=stats.free_pages == stats.total_pages, counters="this cohort",
                      recompiles=sum(after.values()) - sum(before.values()),
                      prefill_tokens_per_s=sum(map(len, requests)) / result["prefill_s"])
        return result

    start = time.perf_counter()
    cohort(prompts, spec["warmup_tokens"])
    llm.wait_compiles()    # the programs the warm-up ran in a larger bucket, compiled in the background
    warmup_s = time.perf_counter() - start
    return dict(status="ok", warmup_s=warmup_s, repeats=[cohort(prompts, spec["new_tokens"])
                                                         for _ in range(spec["repeats"])])


def _old_worker(spec: dict) -> dict:
    """The pre-engine generate, imported from the old source tree (first on the path: PYTHONPATH)."""
    import inspect

    import wise_jax
    from wise_core.wise_config import WiseConfig
    config, params, prompts = cohort_setup(spec)
    old_api = "kernel" in inspect.signature(wise_jax.generate).parameters   # a later tree: attention_backend
    attention = {"kernel" if old_api else "attention_backend": spec["kernel"]}
    wise_config = None
    if spec["arm"] == "old-wise":
        wise_config = WiseConfig(eta=spec["eta"], **({"kernel": spec["kernel"]} if old_api else {}))

    def run(tokens: int) -> dict:
        return wise_jax.generate(params, config, prompts, max_new_tokens=tokens, eos_token_id=None,
                                 wise_config=wise_config, page_size=spec["page_size"], **attention).stats

    start = time.perf_counter()
    run(spec["warmup_tokens"])
    warmup_s = time.perf_counter() - start
    repeats = []
    for _ in range(spec["repeats"]):
        stats = run(spec["new_tokens"])
        steps = spec["new_tokens"] - 1
        repeats.append(dict(prefill_s=stats["prefill_s"], decode_s=stats["decode_s"],
                            decode_tokens=stats["new_tokens"] - len(prompts), decode_steps=steps,
                            decode_tokens_per_s=stats["decode_tokens_per_s"],
                            ms_per_step=1e3 * stats["decode_s"] / steps, density=stats["density"],
                            fallbacks=stats["fallbacks"], preemptions=None, pages_returned=None,
                            recompiles=stats["compiles"]))
    return dict(status="ok", warmup_s=warmup_s, repeats=repeats)


def worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = (_old_worker if spec["arm"].startswith("old") else _engine_worker)(spec)
        result["environment"] = rp.environment("jax")
    except Exception as e:  # reported in the row; the other arms go on
        traceback.print_exc()
        result = dict(status=f"error: {type(e).__name__}: {e}"[:800])
    Path(spec["result"]).write_text(json.dumps(result, default=str))


def arm_env(arm: str, extra_flags: tuple[str, ...] = (), first: str | None = None, **extra: str) -> dict:
    """The environment of an arm's worker process: this one's, `first` (an old source tree) and
    the repository on its path, with `extra` and the arm's XLA flags (and `extra_flags`) added."""
    env = rp.module_env(first, PYTHONUNBUFFERED="1", **extra)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    flags = [XLA_FLAGS[o] for o in parse_arm(arm)[1] if o in XLA_FLAGS] + list(extra_flags)
    if flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", "")] + flags).strip()
    return env


def run_worker(spec: dict, timeout: float, workdir: Path, compile_cache: Path) -> dict:
    """Run one (shape, arm) in a fresh process (its XLA flags set); its result, or why there is none."""
    name = f"{spec['context']}x{spec['batch']}-{spec['arm']}"
    spec = dict(spec, result=str(workdir / f"{name}.result.json"))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = arm_env(spec["arm"], first=spec.get("old_src"), JAX_COMPILATION_CACHE_DIR=str(compile_cache),
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    try:
        done = subprocess.run(rp.module_command("engine.jax_generate_bench", "--worker", str(spec_path)),
                              cwd=workdir if spec.get("old_src") else None, env=env, timeout=timeout,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return dict(status=f"error: timed out after {timeout:.0f} s")
    log = (done.stdout + done.stderr).strip()
    if done.returncode != 0 or not Path(spec["result"]).exists():
        return dict(status=f"error: worker exited {done.returncode}: {log[-600:]}")
    result = json.loads(Path(spec["result"]).read_text())
    warnings = [line for line in log.splitlines() if "by rematerialization" in line]   # XLA could not fit a program
    result.update(remat_warnings=len(warnings), remat_warning=warnings[0][-300:] if warnings else None)
    if result["status"] != "ok" and log:
        result["log_tail"] = log[-1500:]
    return result


# -- the report ------------------------------------------------------------------------------------------------
def row_of(spec: dict, result: dict, repeat: int | None, config, args) -> dict:
    row = dict(context=spec["context"], batch=spec["batch"], q_scale=spec["q_scale"], arm=spec["arm"],
               repeat=repeat, status=result["status"], warmup_s=result.get("warmup_s"),
               remat_warnings=result.get("remat_warnings"), remat_warning=result.get("remat_warning"))
    if repeat is None:
        return row
    r = result["repeats"][repeat]
    density = {int(k): v for k, v in (r.get("density") or {}).items() if v is not None} or None
    roof = roofline(config, args.dtype, spec["context"], spec["batch"], spec["new_tokens"], density, args.hbm_tbps,
                    spec.get("num_steps"))
    row.update({k: r.get(k) for k in ("decode_tokens_per_s", "ms_per_step", "prefill_s", "prefill_tokens_per_s",
                                      "decode_tokens", "decode_steps", "fallbacks", "preemptions",
                                      "pages_returned", "recompiles", "mean_depth", "tokens")})
    row.update(density=density, roofline_tokens_per_s=roof["tokens_per_s"], roofline_ms_per_step=roof["ms_per_step"],
               roofline_share=r["decode_tokens_per_s"] / roof["tokens_per_s"])
    return row


def dense_of(arm: str) -> str:
    """The arm a WISE arm is compared with: the same options, dense (old-wise: old)."""
    mode, options = parse_arm(arm)
    return "+".join((base_of(mode),) + options)


def summarize(rows: list[dict]) -> list[dict]:
    """Mean over repeats per (shape, arm); WISE arms over their dense arm, variants over the base arm,
    adaptive arms over their fixed-depth arm; per arm the requests whose greedy tokens (first
    repeat) differ from the dense arm's of the same options."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["repeat"] is not None and not r.get("prefill_only"):
            groups.setdefault((r["context"], r["batch"], r["arm"]), []).append(r)
    out = []
    for (context, batch, arm), rs in groups.items():
        mean = sum(r["decode_tokens_per_s"] for r in rs) / len(rs)
        out.append(dict(context=context, batch=batch, arm=arm, decode_tokens_per_s=mean,
                        ms_per_step=sum(r["ms_per_step"] for r in rs) / len(rs),
                        roofline_tokens_per_s=rs[-1]["roofline_tokens_per_s"],
                        roofline_share=mean / rs[-1]["roofline_tokens_per_s"], density=rs[-1]["density"],
                        mean_depth=mean_depth(rs)))
    by_key = {(s["context"], s["batch"], s["arm"]): s for s in out}
    tokens = {key: rs[0].get("tokens") for key, rs in groups.items()}
    for s in out:
        mode, options = parse_arm(s["arm"])
        base = by_key.get((s["context"], s["batch"], mode))
        dense = by_key.get((s["context"], s["batch"], dense_of(s["arm"]))) if "wise" in mode else None
        fixed = by_key.get((s["context"], s["batch"], "+".join((ADAPTIVE_ARMS[mode],) + options))) \
            if mode in ADAPTIVE_ARMS else None
        s["over_dense"] = s["decode_tokens_per_s"] / dense["decode_tokens_per_s"] if dense else None
        s["over_base"] = s["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base and base is not s else None
        s["over_fixed"] = s["decode_tokens_per_s"] / fixed["decode_tokens_per_s"] if fixed else None
        mine, reference = (tokens.get((s["context"], s["batch"], arm)) for arm in (s["arm"], dense_of(s["arm"])))
        s["differ"] = None if mine is None or reference is None else compare_tokens(reference, mine)["differ"]
    return out


def markdown(report: dict) -> str:
    env = report.get("environment") or {}
    a = report["args"]
    lines = [f"# JAX decode throughput ({report['date']})", "",
             f"{env.get('device', '?')}; jax {env.get('jax', '?')}, jaxlib {env.get('jaxlib', '?')}, python "
             f"{env.get('python', '?')}; model {report['model']}; {a['dtype']}; kernel {a['kernel']}; "
             f"{a['new_tokens']} new tokens per request, {a['repeats']} repeats after a warm-up cohort; "
             f"page size {a['page_size']}; roofline at {a['hbm_tbps']} TB/s{run_text(report)}.", "",
             "## Every run", ""]
    lines += table([r for r in report["rows"] if not r.get("prefill_only")])
    flagged = [f"{r['context']} x {r['batch']} {r['arm']} repeat {r['repeat'] + 1}: "
               + ", ".join(([f"{r['fallbacks']} fallbacks"] if r.get("fallbacks") else [])
                           + ([f"{r['recompiles']} recompiles"] if r.get("recompiles") else [])
                           + (["pages not all returned to the pool"] if r.get("pages_returned") is False else []))
               for r in report["rows"] if r["repeat"] is not None
               and (r.get("fallbacks") or r.get("recompiles") or r.get("pages_returned") is False)]
    if flagged:
        lines += ["", "Flagged: " + "; ".join(flagged) + "."]
    lines += ["", "## Mean over repeats", "",
              "over dense: a WISE arm's tok/s over its dense arm (same options); over base: a variant's tok/s "
              "over the arm without options; mean depth: the core iterations a decoded token of an adaptive arm "
              "ran; over fixed: an adaptive arm's tok/s over its fixed-depth arm's (adaptive: dense; "
              "wise-adaptive: wise; same options; exited rows ride along, every iteration runs); differ: requests "
              "whose greedy tokens differ from the dense arm's (an adaptive arm's are the exits': not an error).",
              "", "| ctx x batch | arm | decode tok/s | ms/step | share of roofline | over dense | over base | density "
              "| mean depth | over fixed | differ |", "|" + "---|" * 11]
    for s in report["summary"]:
        lines.append(f"| {s['context']} x {s['batch']} | {s['arm']} | {s['decode_tokens_per_s']:.1f} | "
                     f"{s['ms_per_step']:.2f} | {s['roofline_share']:.0%} | {rp.fmt(s['over_dense'], '.2f')} | "
                     f"{rp.fmt(s['over_base'], '.2f')} | {density_text(s['density'])} | "
                     f"{rp.fmt(s.get('mean_depth'), '.2f')} | {rp.fmt(s.get('over_fixed'), '.2f')} | "
                     f"{rp.fmt(s.get('differ'), 'd')} |")
    prefill = [r for r in report["rows"] if r.get("prefill_only")]
    if prefill:
        lines += ["", "## Prefill", "", "| ctx x batch | repeat | prefill s | prompt tok/s | status |",
                  "|---|---|---|---|---|"]
        for r in prefill:
            lines.append(f"| {r['context']} x {r['batch']} | {'' if r['repeat'] is None else r['repeat'] + 1} | "
                         f"{rp.fmt(r.get('prefill_s'), '.2f')} | {rp.fmt(r.get('prefill_tokens_per_s'), '.0f')} | "
                         f"{r['status']} |")
    return "\n".join(lines + targets_section(report)) + "\n"


def write_report(report: dict, out: Path) -> None:
    rp.write_report(out, STEM, report, markdown(report), lambda path: plot(report, path))


def main(argv: list[str] | None = None) -> dict | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return None
    scales = check_args(parser, args)
    from wise_core.presets import PRESETS
    if args.preset not in PRESETS:
        raise SystemExit(f"unknown --preset {args.preset!r}; one of {sorted(PRESETS)}")
    config = dataclasses.replace(PRESETS[args.preset], eos_token_id=None)
    if args.layers and config.architecture == "huginn":
        parser.error("--layers overrides an Ouro preset's shared layers; a Huginn model has a prelude, a core block "
                     "and a coda")
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    steps = check_depth(parser, args, config, [a for a in args.arms if a.startswith("old")
                                               or set(parse_arm(a)[1]) & set(OURO_LAYOUT)],
                        [a for a in args.arms if parse_arm(a)[0] in ADAPTIVE_ARMS])
    threshold = adaptive_threshold(args)
    workdir = Path(tempfile.mkdtemp(prefix="wise-jax-bench-"))
    compile_cache = args.compile_cache or workdir / "compile-cache"
    try:
        old = any(a.startswith("old") for a in args.arms)
        old_src = prepare_old_src(args, workdir, ("wise_core", "wise_jax")) if old else None
        report = dict(date=rp.now(), host=platform.node(),
                      model=f"random {args.preset} (std {args.std}, seed 0)", config=dataclasses.asdict(config),
                      num_steps=steps, wise_profile=wise_profile(config, steps, args.arms, args.eta),
                      adaptive_depth=adaptive_text(args.arms, threshold), old_src=old_src, args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                      environment=None, rows=[], summary=[], standing=[])
        print(f"{'ctx x batch':>13} {'arm':>16} {'rep':>3} {'tok/s':>9} {'ms/step':>8} {'roof tok/s':>10} "
              f"{'share':>6} density", flush=True)
        runs = [((c, b), s, arm, args.new_tokens) for (c, b), s in zip(args.shapes, scales) for arm in args.arms]
        runs += [((c, b), 1.0, "dense", 2) for c, b in args.prefill_shapes]
        for index, ((context, batch), q_scale, arm, new_tokens) in enumerate(runs):
            prefill_only = index >= len(runs) - len(args.prefill_shapes)
            spec = dict(arm=arm, context=context, batch=batch, q_scale=q_scale, config=config_fields(config),
                        num_steps=steps, std=args.std, seed=0, dtype=args.dtype, kernel=args.kernel, eta=args.eta,
                        adaptive_threshold=threshold, page_size=args.page_size,
                        num_pages=cohort_pages(context, batch, new_tokens, args.page_size) + 1,
                        new_tokens=new_tokens, warmup_tokens=args.warmup_tokens,
                        repeats=1 if prefill_only else args.repeats, old_src=old_src if arm.startswith("old") else None)
            if arm.startswith("old") and old_src is None:
                result = dict(status=f"error: no old source tree (--old-src, or git history with {args.old_commit})")
            else:
                result = run_worker(spec, args.child_timeout, workdir, compile_cache)
            report["environment"] = report["environment"] or result.get("environment")
            label = "prefill" if prefill_only else arm
            if result["status"] != "ok":
                report["rows"].append(dict(row_of(spec, result, None, config, args), prefill_only=prefill_only,
                                           log_tail=result.get("log_tail")))
                print(f"{context:>6} x {batch:<4} {label:>16}   {result['status'][:300]}", flush=True)
            for i in range(len(result.get("repeats", ()))):
                row = dict(row_of(spec, result, i, config, args), prefill_only=prefill_only)
                report["rows"].append(row)
                print(f"{context:>6} x {batch:<4} {label:>16} {i + 1:>3} {row['decode_tokens_per_s']:>9.1f} "
                      f"{row['ms_per_step']:>8.2f} {row['roofline_tokens_per_s']:>10.0f} "
                      f"{row['roofline_share']:>6.0%} {density_text(row['density'])}"
                      + (f"  mean depth {row['mean_depth']:.2f}" if row.get("mean_depth") is not None else "")
                      + f"  prefill "
                      f"{rp.fmt(row['prefill_s'], '.2f')} s  remat warnings {row['remat_warnings']}", flush=True)
            report["summary"] = summarize(report["rows"])
            report["standing"] = engine_standing(report["summary"], config.architecture)
            write_report(report, args.out)  # after every arm: a run cut short still leaves a report
        print(markdown(report))
        return report
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
