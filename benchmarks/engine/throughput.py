"""Decode throughput of the serving engine (wise_torch.LLM): dense, WISE, FA4 and the pre-engine path.

    python -m benchmarks.engine.throughput --preset ouro-1.4b --shapes 1024x64,4096x20,8192x10 \\
        --q-scale 8,7.3,7 --old-src .old-src --out benchmarks/results/DIR            # on an H200
    python -m benchmarks.engine.throughput --preset test-tiny --dtype float32 --device cpu --kernel reference \\
        --shapes 64x3 --new-tokens 6 --old-src . --out /tmp/tp                         # CPU smoke
    python -m benchmarks.engine.throughput --preset huginn-0125 --num-steps 32 --kernel reference \\
        --shapes 1024x32,4096x8 --q-scale 3.1,2.83 --arms dense,wise,adaptive --out DIR # Huginn, on an H200

Method (the reference system's): a cohort of C concurrent requests of exactly L prompt tokens
(random ids, seed fixed per shape, the same for every arm), greedy, N output tokens each with
ignore_eos. The step loop is timed on the host: decode throughput counts only the tokens
generated after the step in which the whole cohort has its first token, over the time from that
step to the last; ms/step is that time over those steps; "prefill s" is the time from the first
add_request to that step. Each (shape, arm) runs in a fresh process (this module with --worker),
with an identical KV pool for every engine arm (num_pages = the cohort's pages + 1), one untimed
warm-up cohort (--warmup-tokens new tokens: compiles kernels, captures graphs) and --repeats timed
cohorts, all printed.

Arms:
- dense: the engine, Triton dense decode (`attention_backend=--kernel`, no WISE);
- wise: the engine with WISE (`WiseConfig(eta)`, `attention_backend=--kernel`);
- fa4: the engine with FlashAttention-4 for prefill and dense decode (`attention_backend="fa4"`)
  when `flash_attn.cute` imports (else a 'not importable' row);
- wise-fa4: WISE as the reference system's FlashAttention path runs it (the union arm
  `wise_decode="fa4-union"`, through `arms.torch_engine_with`: reuse rows over the page-granular
  head union of their support; not the decode contract), its dense loops and prefill on FA4 too;
- adaptive, wise-adaptive (Huginn only: an Ouro model exits by its config's early_exit_threshold):
  the dense / wise arm's engine with per-token adaptive depth
  (`adaptive_depth=AdaptiveDepth(threshold=--adaptive-threshold)`, the released KL exit criterion,
  min_steps 0, at most --num-steps iterations). Rows that exit ride along: every iteration still
  runs every row, so the arm's step does the fixed-depth arm's work plus the exit checks (the
  coda and the LM head after each iteration but the last). Also reported: the mean depth
  (`stats().mean_decode_depth`: core iterations a decoded token ran, this cohort's) and the
  tok/s over the fixed-depth arm of the same kind (adaptive: dense; wise-adaptive: wise); their
  tokens are the exits', so "differ" counts requests whose tokens differ from dense's (expected,
  not an error);
- adaptive-regroup (Huginn only): the adaptive arm regrouped by depth
  (`LLM(adaptive_regroup=True)`): after each checked iteration only the rows still running run
  the later iterations (the adaptive arm's tokens and depths). Its rows are gathered (dynamic
  shapes), so it runs eager: the arm sets cuda_graphs=False whatever --cuda-graphs says, and on
  a GPU its timing is not comparable with the graph-captured arms' (on CPU every arm is eager);
- spec-wise, spec-wise2, spec-wise-sparse, spec-loops (`--spec wise|wise2|wise-sparse|loops
  --num-draft K`): the engine with lossless speculative decoding (`speculative_arms`); also
  reported: acceptance, tokens per round, and how many
  requests' greedy tokens differ from the dense arm's (every engine arm is compared);
  `--accept-rate P,...` times them at set acceptances instead (spec-wise@P: real drafts and
  verification, a seeded Bernoulli(P) accept; tokens not the model's);
- old, old-wise: the pre-engine `wise_torch.generate` (dense / WISE), measured by running the old
  commit's own code, not a copy: a source tree of that commit (--old-src DIR; make one with
  `git archive OLD_COMMIT wise_core wise_torch | tar -x -C DIR`, or let --old-commit extract it
  when git history is at hand) goes first on the worker's path (PYTHONPATH). Its timing is generate's
  own (GenerationStats: decode after the batched prefill that gives every row its first token,
  tokens after those first ones), after one untimed warm-up call; it sizes its own KV pool
  (the cohort's pages exactly).

Workloads: --model DIR (a checkpoint or built-in name) or random weights at a preset's shape
(--preset, normal(0, --std) as `wise_core.checkpoint.random_init` says, drawn on the device by
each worker, every HF tensor from its own generator seeded by crc32(name) + seed, so every arm,
the pre-engine layout included, holds the same weights), with the queries multiplied by
--q-scale (one value, or one per shape) to give peaked attention (`random_recipe` says which rows:
Ouro's q_proj; Huginn's q rows of attn.Wqkv and q's half of attn.qk_bias).

Huginn (a Huginn --preset or --model: huginn-0125, test-tiny-huginn): every token runs
--num-steps core iterations (default the config's total_ut_steps; an Ouro model runs its loops,
and --num-steps, if given, must equal them); the wise arms use `huginn_wise_config(num_steps)`
(discovery on iterations 0 and 1, reuse on the rest; --eta), wise-default
`huginn_wise_config(num_steps)` with every other setting at its default; the old and speculative
arms run Ouro only. The report states the WISE profile; the issue's targets are Ouro-1.4B's, and
a Huginn run is held to none.

Per arm and repeat: decode tok/s, ms/step, the roofline tok/s and the share of it reached,
the reuse-union density per reuse depth (LLM.stats(); the old path's GenerationStats), fallbacks,
preemptions, prefill time. Roofline per step = bytes / --hbm-tbps (4.3 TB/s), bytes = the weights
a step reads (`weight_bytes_per_step`: Ouro's layers, final norm and exit gate once per loop;
Huginn's prelude, coda and ln_f once, its core block and adapter once per core iteration; the LM
head once; from the checkpoint's tensor shapes) plus every plane's K and V at the cohort's mean
context L + N/2 (`kv_bytes_per_step`: Ouro's (loop, layer) planes, Huginn's `num_planes`; WISE:
reuse planes at the measured density). An adaptive arm's roofline is its fixed-depth arm's
(riding along, every iteration runs every row; its exit checks' reads are not counted, so its
share is against the fixed-depth step's bound; adaptive-regroup's step reads the same weights
per iteration run but fewer rows' K/V, and is held to the same bound). Writes throughput.json, throughput.md (with the
standing against the issue's targets) and throughput.png to --out, and prints a table.

This module is the command line and the per-(shape, arm) worker; the parts it shares with the
other engine benchmarks are `arms` (the arms and their WISE profile), `workload` (shapes,
prompts, random weights), `timing` (the step loop, the roofline) and `decode_report` (summary,
targets, markdown, plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import traceback
from pathlib import Path

from benchmarks import report as rp
from benchmarks.engine import speculative_arms
from benchmarks.engine.arms import (ADAPTIVE_ARMS, ARMS, CUDA_GRAPHS, FA4_ARMS, OLD_COMMIT, adaptive_text,
                                    adaptive_threshold, check_depth, parse_arms, parse_threshold, prepare_old_src,
                                    torch_engine_with, wise_config_of, wise_profile)
from benchmarks.engine.decode_report import density_text, markdown, row_of, standing, summarize, write_report
from benchmarks.engine.timing import DTYPE_BYTES, HBM_TBPS, reset_counters, run_cohort, stats_dict
from benchmarks.engine.workload import (cohort_pages, load_model, parse_floats, parse_shapes, prepare_model,
                                        random_prompts, random_recipe)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory or built-in name (default: random --preset weights)")
    p.add_argument("--preset", default="ouro-1.4b", help="model shape for random weights (wise_core PRESETS)")
    p.add_argument("--layers", type=int, default=0, help="override the preset's num_hidden_layers (Ouro)")
    p.add_argument("--num-steps", type=int, help="a Huginn model's core iterations (default: total_ut_steps)")
    p.add_argument("--std", type=float, default=0.02, help="std of the random weights")
    p.add_argument("--q-scale", type=parse_floats, default=[1.0],
                   help="query multiplier: one value, or one per shape (e.g. 8,7.3,7)")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1024x64,4096x20,8192x10"),
                   help="CONTEXTxBATCH list: prompt tokens x concurrent requests")
    p.add_argument("--new-tokens", type=int, default=32, help="output tokens per request (>= 2)")
    p.add_argument("--warmup-tokens", type=int, default=4, help="output tokens of the untimed warm-up cohort")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arms", type=parse_arms, default=[a for a in ARMS if a not in ADAPTIVE_ARMS],
                   help=f"comma-separated, of {ARMS} (default: all but the adaptive ones, which run Huginn only)")
    p.add_argument("--adaptive-threshold", type=parse_threshold, default=None,
                   help="KL exit threshold of the adaptive arms (default: AdaptiveDepth's, the released 1e-3)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernel", default="triton", choices=("triton", "reference", "auto"),
                   help="the attention_backend of the dense and wise arms (the decode kernel of the old ones)")
    p.add_argument("--eta", type=float, default=0.95)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--num-pages", type=int, default=0, help="KV pool of the engine arms (default: the cohort's + 1)")
    p.add_argument("--cuda-graphs", default="auto", choices=sorted(CUDA_GRAPHS), help="LLM(cuda_graphs=) of the engine arms")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="LLM(max_num_batched_tokens=): prompt tokens per step (default: the engine's)")
    p.add_argument("--old-src", type=Path, help="source tree of the pre-engine commit (wise_core, wise_torch)")
    p.add_argument("--old-commit", default=OLD_COMMIT, help="commit to extract with git when --old-src is not given")
    p.add_argument("--hbm-tbps", type=float, default=HBM_TBPS, help="memory bandwidth of the roofline")
    p.add_argument("--child-timeout", type=float, default=600, help="seconds per (shape, arm) process")
    p.add_argument("--out", type=Path, default=rp.RESULTS)
    speculative_arms.add_arguments(p)
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
    if args.page_size < 1 or args.num_pages < 0 or args.max_num_batched_tokens < 0 or args.hbm_tbps <= 0:
        parser.error("--page-size and --hbm-tbps must be positive, --num-pages and --max-num-batched-tokens >= 0")
    scales = args.q_scale
    if len(scales) == 1:
        scales = scales * len(args.shapes)
    if len(scales) != len(args.shapes):
        parser.error(f"--q-scale gives {len(args.q_scale)} values for {len(args.shapes)} shapes (give 1 or one each)")
    if args.num_pages:
        short = [(L, C) for L, C in args.shapes
                 if args.num_pages < cohort_pages(L, C, args.new_tokens, args.page_size)]
        if short:
            parser.error(f"--num-pages {args.num_pages} cannot hold the cohort of shapes {short}")
    return scales


def _engine_worker(spec: dict) -> dict:
    arm = spec["arm"]
    if arm in FA4_ARMS:
        try:
            importlib.import_module("flash_attn.cute")
        except Exception as e:  # not installed, or installed without its CUDA parts
            return dict(status=f"not importable: {type(e).__name__}: {e}"[:300])
    import torch
    import wise_torch
    model = load_model(spec)
    config, num_steps = model.config, spec.get("num_steps")   # None: the model's total_ut_steps
    steps = config.total_ut_steps if num_steps is None else num_steps
    speculating = speculative_arms.is_spec(arm)
    prompts = random_prompts(spec, config.vocab_size)
    if arm.endswith("-default"):
        llm = wise_torch.LLM(model, num_steps=num_steps,
                             wise_config=wise_config_of(config, steps) if arm == "wise-default" else None)
    else:
        if speculating:
            configs = speculative_arms.engine_kwargs(arm, spec)
        else:
            configs = dict(wise_config=wise_config_of(config, steps, eta=spec["eta"])
                           if arm in ("wise", "wise-fa4", "wise-adaptive") else None)
        cuda_graphs = CUDA_GRAPHS[spec["cuda_graphs"]]
        if arm in ADAPTIVE_ARMS:
            from wise_core.adaptive_depth import AdaptiveDepth
            configs["adaptive_depth"] = AdaptiveDepth(threshold=spec["adaptive_threshold"])
        if arm == "adaptive-regroup":   # gathers rows (dynamic shapes): eager
            configs["adaptive_regroup"], cuda_graphs = True, False
        build, attention_backend = wise_torch.LLM, spec["kernel"]
        if arm in FA4_ARMS:
            attention_backend = "fa4"
            if arm == "wise-fa4":
                build = torch_engine_with(wise_decode="fa4-union")
        extra = {"max_num_batched_tokens": spec["max_num_batched_tokens"]} if spec["max_num_batched_tokens"] else {}
        if spec.get("tensor_parallel_size", 1) > 1:   # benchmarks/engine/tp_scaling.py
            extra["tensor_parallel_size"] = spec["tensor_parallel_size"]
        llm = build(model, **configs, num_steps=num_steps, num_pages=spec["num_pages"],
                    page_size=spec["page_size"], max_num_seqs=spec["batch"],
                    cuda_graphs=cuda_graphs, attention_backend=attention_backend,
                    max_model_len=spec["context"] + max(spec["new_tokens"], spec["warmup_tokens"]), **extra)
    rate = speculative_arms.method_and_rate(arm)[1] if speculating else None
    if rate is not None:   # spec-METHOD@P: timed at a set acceptance
        speculative_arms.set_acceptance(llm, rate)
    del model   # under tensor parallelism the engine holds rank 0's shard, not the whole model

    def cohort(tokens: int) -> dict:
        params = wise_torch.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        reset = reset_counters(llm)
        before = speculative_arms.counters(llm.stats()) if speculating else None
        result = run_cohort(llm, prompts, params, tokens)
        if speculating:
            result.update(speculative_arms.cohort_fields(before, speculative_arms.counters(llm.stats())))
        stats = stats_dict(llm.stats())
        result.update(stats=stats, density=stats.get("density"), fallbacks=stats.get("fallbacks"),
                      counters="this cohort" if reset else "since the engine started",
                      preemptions=stats.get("preemptions"),
                      mean_depth=stats.get("mean_decode_depth") if arm in ADAPTIVE_ARMS else None,
                      pages_returned=stats.get("free_pages") == stats.get("total_pages"))
        return result

    with torch.inference_mode():
        cohort(spec["warmup_tokens"])
        repeats = [cohort(spec["new_tokens"]) for _ in range(spec["repeats"])]
    if hasattr(llm, "close"):
        llm.close()
    return dict(status="ok", repeats=repeats)


def _old_worker(spec: dict) -> dict:
    """The pre-engine generate, imported from the old source tree (first on the path: PYTHONPATH).
    That tree names the decode attention `kernel` (of generate and WiseConfig); a later tree given
    as --old-src (the smoke test runs this one) names it `attention_backend`."""
    import inspect

    import torch
    import wise_torch
    from wise_core.wise_config import WiseConfig
    model = load_model(spec)
    prompts = random_prompts(spec, model.config.vocab_size)
    old_api = "kernel" in inspect.signature(wise_torch.generate).parameters
    attention = {"kernel" if old_api else "attention_backend": spec["kernel"]}
    wise_config = None
    if spec["arm"] == "old-wise":
        wise_config = WiseConfig(eta=spec["eta"], **({"kernel": spec["kernel"]} if old_api else {}))

    def run(tokens: int):
        return wise_torch.generate(model, prompts, max_new_tokens=tokens, eos_token_id=None, wise_config=wise_config,
                                   page_size=spec["page_size"], **attention)

    with torch.inference_mode():
        run(spec["warmup_tokens"])
        repeats = []
        for _ in range(spec["repeats"]):
            stats = run(spec["new_tokens"]).stats
            steps = spec["new_tokens"] - 1
            repeats.append(dict(prefill_s=stats.prefill_s, decode_s=stats.decode_s,
                                decode_tokens=stats.new_tokens - len(prompts), decode_steps=steps,
                                decode_tokens_per_s=stats.decode_tokens_per_s, ms_per_step=1e3 * stats.decode_s / steps,
                                density=stats.density, fallbacks=stats.fallbacks, preemptions=None,
                                pages_returned=None))
    return dict(status="ok", repeats=repeats)


def worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["device"] == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        result = (_old_worker if spec["arm"].startswith("old") else _engine_worker)(spec)
        if result["status"] == "ok":
            result["environment"] = rp.environment("torch")
    except Exception as e:  # reported in the row; the other arms go on
        traceback.print_exc()
        result = dict(status=f"error: {type(e).__name__}: {e}"[:800])
    Path(spec["result"]).write_text(json.dumps(result, default=str))


def run_worker(spec: dict, timeout: float, workdir: Path) -> dict:
    """Run one (shape, arm) in a fresh process; its result, or a row saying why there is none."""
    name = f"{spec['context']}x{spec['batch']}-{spec['arm']}"
    spec = dict(spec, result=str(workdir / f"{name}.result.json"))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = rp.module_env(spec.get("old_src"), PYTHONUNBUFFERED="1")  # an old tree first on the path
    try:
        done = subprocess.run(rp.module_command("engine.throughput", "--worker", str(spec_path)),
                              cwd=workdir if spec.get("old_src") else None,
                              env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return dict(status=f"error: timed out after {timeout:.0f} s")
    log = (done.stdout + done.stderr).strip()
    if done.returncode != 0 or not Path(spec["result"]).exists():
        return dict(status=f"error: worker exited {done.returncode}: {log[-600:]}")
    result = json.loads(Path(spec["result"]).read_text())
    if result["status"] != "ok" and log:
        result["log_tail"] = log[-1500:]
    return result


def main(argv: list[str] | None = None) -> dict | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return None
    scales = check_args(parser, args)
    workdir = Path(tempfile.mkdtemp(prefix="wise-throughput-"))
    try:
        config, checkpoint, fields = prepare_model(args)
        steps = check_depth(parser, args, config, [a for a in args.arms if a.startswith("old")]
                            + speculative_arms.arms_of(args), [a for a in args.arms if a in ADAPTIVE_ARMS])
        threshold = adaptive_threshold(args)
        old_src = prepare_old_src(args, workdir) if any(a.startswith("old") for a in args.arms) else None
        report = dict(date=rp.now(), host=platform.node(),
                      model=args.model or f"random {args.preset} (std {args.std}, seed 0)",
                      config=dataclasses.asdict(config), num_steps=steps,
                      wise_profile=wise_profile(config, steps, args.arms, args.eta),
                      adaptive_depth=adaptive_text(args.arms, threshold), old_src=old_src,
                      args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                      environment=None, rows=[])
        tensors = random_recipe(config) if fields is not None else None
        print(f"{'ctx x batch':>13} {'arm':>9} {'rep':>3} {'tok/s':>9} {'ms/step':>8} {'roof tok/s':>10} "
              f"{'share':>6} density", flush=True)
        for (context, batch), q_scale in zip(args.shapes, scales):
            num_pages = args.num_pages or cohort_pages(context, batch, args.new_tokens, args.page_size) + 1
            for arm in args.arms + speculative_arms.arms_of(args):
                spec = dict(arm=arm, context=context, batch=batch, q_scale=q_scale, checkpoint=checkpoint,
                            random=fields, tensors=tensors, num_steps=steps, std=args.std, seed=0,
                            dtype=args.dtype, device=args.device, kernel=args.kernel, eta=args.eta,
                            adaptive_threshold=threshold,
                            page_size=args.page_size, num_pages=num_pages, cuda_graphs=args.cuda_graphs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            new_tokens=args.new_tokens, warmup_tokens=args.warmup_tokens, repeats=args.repeats,
                            num_draft=args.num_draft, draft_loops=args.draft_loops,
                            adaptive_draft=args.adaptive_draft, old_src=old_src if arm.startswith("old") else None)
                if arm.startswith("old") and old_src is None:
                    result = dict(status=f"error: no old source tree (--old-src, or git history with {args.old_commit})")
                else:
                    result = run_worker(spec, args.child_timeout, workdir)
                report["environment"] = report["environment"] or result.get("environment")
                if result["status"] != "ok":
                    report["rows"].append(dict(row_of(spec, result, None, config, args),
                                               log_tail=result.get("log_tail")))
                    print(f"{context:>6} x {batch:<4} {arm:>9}   {result['status'][:200]}", flush=True)
                for i in range(len(result.get("repeats", ()))):
                    row = row_of(spec, result, i, config, args)
                    report["rows"].append(row)
                    print(f"{context:>6} x {batch:<4} {arm:>9} {i + 1:>3} {row['decode_tokens_per_s']:>9.1f} "
                          f"{row['ms_per_step']:>8.2f} {row['roofline_tokens_per_s']:>10.0f} "
                          f"{row['roofline_share']:>6.0%} {density_text(row['density'])}"
                          + (f" mean depth {row['mean_depth']:.2f}" if row.get("mean_depth") is not None else "")
                          + (f" acceptance {row['acceptance_rate']:.3f}, {row['tokens_per_round']:.2f} tok/round"
                             if row.get("acceptance_rate") is not None else ""), flush=True)
                report["summary"] = summarize(report["rows"])
                report["standing"] = standing(report["summary"], config.architecture)
                write_report(report, args.out)  # after every arm: a run cut short still leaves a report
        print(markdown(report))
        return report
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
