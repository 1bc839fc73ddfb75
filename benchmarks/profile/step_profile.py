"""Where a decode step's time goes, in both engines: every kernel of a step put in one category.

    python -m benchmarks.profile.step_profile --frameworks torch,jax --shapes 1024x64,4096x20,8192x10,1024x1 \\
        --q-scale 8,7.3,7,8 --out DIR                                                  # on an H200
    python -m benchmarks.profile.step_profile --preset test-tiny --dtype float32 --kernel reference \\
        --shapes 64x2 --steps 2 --out /tmp/sp                                           # CPU smoke

Each (framework, shape, arm) runs in a fresh process with the engine's constructor defaults
(`wise_torch.LLM(model)` / `wise_jax.LLM(params, config)`, `--tight` for max_model_len = context +
steps), a cohort of C random prompts of L tokens, greedy: once every request has its first token
and the step is compiled (graphs captured), --steps steps are timed on the host, then --steps more
run under the profiler (torch.profiler / jax.profiler). A step's kernels, in launch order, go to:

- gemm: cuBLAS / XLA GEMM kernels (the projections and the LM head);
- attention, discovery loops / attention, reuse loops: the decode-attention kernels (split, list,
  finish), the n-th attention call of a step being plane n, loop n // layers (a dense arm is
  split at the same loops, so the two arms compare loop for loop);
- selection / support bookkeeping: WISE state work outside the attention kernels (modes, tags,
  counters, support masks; JAX: kernels whose HLO comes from `wise_jax/wise_state.py`; torch:
  kernels between the first and the last GEMM that are none of the others);
- norms / RoPE / KV writes / elementwise: the fused layer ops (torch), XLA fusions from the model
  and the cache (JAX);
- sampling and readback: after the step's last GEMM (the LM head): sampling, the token copies;
- inputs: before the step's first GEMM (embedding, staged inputs).
JAX kernels are traced to their source through the step's optimised HLO (dumped by the worker:
a fusion's `stack_frame_id` names the project line it came from); kernels it cannot trace fall
back to the torch rules (--keep-hlo keeps that HLO). `host gap` = host ms per step - kernel ms per step (time the device
waited on the host or between launches). Writes, per shape, DIR/<L>x<C>/step_profile.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import re
import shutil
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import report as rp
from benchmarks.profile.device_trace import device_lines, stream_kernels
from benchmarks.engine.workload import parse_floats, parse_shapes

CATEGORIES = ("gemm", "attention, discovery loops", "attention, reuse loops", "selection / support bookkeeping",
              "norms / RoPE / KV writes / elementwise", "sampling and readback", "inputs")
GEMM_KEYS = ("nvjet", "gemm", "cutlass", "splitkreduce", "xmma", "cublas", "gemv", "aten::mm", "aten::addmm",
             "aten::linear", "aten::matmul", "aten::bmm")
# Attention kernels: the main kernel of a call (one per call) and the kernels that finish it.
ATTENTION_MAIN = ("_split_kernel", "anonymous_mosaic_gpu_kernel", "wise_decode_split", "wise_decode_list",
                  "flash_fwd", "fmha", "cudnn")
ATTENTION_FINISH = ("_finish_kernel", "wise_decode_finish")
FUSED_OPS = ("_rms_norm", "_add_rms_norm", "_rope_store_kv", "_silu_mul")
SOURCE_CATEGORY = (("wise_state.py", "selection / support bookkeeping"), ("attention.py", "attention"),
                   ("/kernels/", "attention"), ("engine.py", "sampling and readback"),
                   ("wise_jax/engine/", "sampling and readback"),
                   ("kv_cache.py", "norms / RoPE / KV writes / elementwise"),
                   ("model.py", "norms / RoPE / KV writes / elementwise"))


@dataclasses.dataclass
class Kernel:
    """One device kernel (or, on a CPU, one top-level op) of a profiled run: us timestamps."""
    name: str
    ts: float
    dur: float
    source: str | None = None   # the project file:function it came from, when known (JAX)


def _has(name: str, keys) -> bool:
    lower = name.lower()
    return any(k.lower() in lower for k in keys)


def _is_gemm(name: str) -> bool:
    """A GEMM kernel, or XLA's dot op (a CPU's trace names ops, not kernels)."""
    return _has(name, GEMM_KEYS) or name.lower().startswith("dot")


def categorize(step: list[Kernel], *, layers: int, roles: tuple[str, ...]) -> list[str]:
    """The category of each kernel of one step (launch order); roles: each loop's WISE role. An
    attention call is a run of consecutive attention kernels starting at a main kernel (`ATTENTION_MAIN`;
    where a step has none, as the CPU's reference path, any run of attention kernels by source);
    the n-th call of the step is plane n."""
    gemms = [i for i, k in enumerate(step) if _is_gemm(k.name)]
    first, last = (gemms[0], gemms[-1]) if gemms else (-1, len(step))

    def base(i: int, k: Kernel) -> str:
        if _is_gemm(k.name):
            return "gemm"
        if _has(k.name, ATTENTION_MAIN + ATTENTION_FINISH):
            return "attention"
        if k.source is not None and any(s in k.source for s, _ in SOURCE_CATEGORY):
            return next(c for s, c in SOURCE_CATEGORY if s in k.source)
        if _has(k.name, FUSED_OPS):
            return "norms / RoPE / KV writes / elementwise"
        return "inputs" if i < first else "sampling and readback" if i > last else "selection / support bookkeeping"

    named = any(_has(k.name, ATTENTION_MAIN) for k in step)   # else: a call is a run of attention kernels
    out, calls, previous = [], 0, None
    for i, k in enumerate(step):
        category = base(i, k)
        if category == "attention":
            if (_has(k.name, ATTENTION_MAIN) if named else previous != "attention") or calls == 0:
                calls += 1
            loop = min((calls - 1) // layers, len(roles) - 1)
            out.append("attention, reuse loops" if roles[loop] == "reuse" else "attention, discovery loops")
        else:
            out.append(category)
        previous = category
    return out


def summarize(kernels: list[Kernel], steps: int, *, layers: int, roles: tuple[str, ...], host_ms: float) -> dict:
    """Per-step ms and launches of each category over `steps` profiled steps (each step launches
    the same kernels, so the launch-ordered kernels split into `steps` equal runs)."""
    kernels = sorted(kernels, key=lambda k: k.ts)
    if not kernels or len(kernels) % steps:
        raise ValueError(f"{len(kernels)} kernels do not split into {steps} steps of equal launches")
    n = len(kernels) // steps
    totals = {c: [0.0, 0] for c in CATEGORIES}
    by_name: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for s in range(steps):
        step = kernels[s * n:(s + 1) * n]
        for k, c in zip(step, categorize(step, layers=layers, roles=roles)):
            totals[c][0] += k.dur
            totals[c][1] += 1
            by_name[c, k.name].append(k.dur)
    busy = sum(t for t, _ in totals.values()) / steps / 1e3
    span = (kernels[-1].ts + kernels[-1].dur - kernels[0].ts) / steps / 1e3
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:30]
    return dict(host_ms=host_ms, kernel_ms=busy, span_ms=span, launches=n, host_gap_ms=host_ms - busy,
                categories={c: dict(ms=t / steps / 1e3, launches=m / steps) for c, (t, m) in totals.items()},
                top_kernels=[dict(category=c, name=name[:100], calls=len(d) / steps, us=sum(d) / steps)
                             for (c, name), d in top])


def _cohort(llm, prompts: list, params) -> None:
    """Queue the cohort and step until every request has its first token, then 3 more steps (the
    step's compile or graph capture)."""
    waiting = {llm.add_request(p, params) for p in prompts}
    while waiting:
        waiting -= {out.request_id for out in llm.step() if out.token_ids}
    for _ in range(3):
        llm.step()


def _timed(llm, steps: int, sync) -> float:
    """Host ms per step over `steps` steps."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    sync()
    return 1e3 * (time.perf_counter() - start) / steps


# -- torch -------------------------------------------------------------------------------------
def _torch_kernels(trace: Path, cpu: bool) -> list[Kernel]:
    events = json.loads(trace.read_text())["traceEvents"]
    if not cpu:
        return [Kernel(e["name"], e["ts"], e["dur"]) for e in events
                if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    top, end = [], -1.0
    for e in ops:   # top-level ops only: an op inside another one's span is its child
        if e["ts"] >= end:
            top.append(Kernel(e["name"], e["ts"], e["dur"]))
            end = e["ts"] + e["dur"]
    return top


def _torch_worker(spec: dict, tmp: Path) -> dict:
    import torch
    from benchmarks.engine import workload
    import wise_torch
    from wise_core.model_config import ModelConfig
    from wise_core.wise_config import WiseConfig
    config = ModelConfig(**spec["config"])
    model = workload.random_model(dict(dtype=spec["dtype"], device=spec["device"], std=spec["std"], seed=0,
                                          q_scale=spec["q_scale"]), config)
    tight = dict(max_model_len=spec["context"] + spec["new_tokens"]) if spec["tight"] else {}
    llm = wise_torch.LLM(model, wise_config=WiseConfig() if spec["arm"] == "wise" else None,
                         attention_backend=spec["kernel"], **tight)
    g = torch.Generator().manual_seed(spec["context"] * 1000 + spec["batch"])
    prompts = torch.randint(0, config.vocab_size, (spec["batch"], spec["context"]), generator=g).tolist()
    cuda = spec["device"] == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode():
        _cohort(llm, prompts, wise_torch.SamplingParams(max_tokens=spec["new_tokens"], ignore_eos=True))
        host_ms = _timed(llm, spec["steps"], sync)
        activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as prof:
            _timed(llm, spec["steps"], sync)
    prof.export_chrome_trace(str(tmp / "trace.json"))
    stats = llm.stats()
    env = "torch {torch}; {device}".format(**rp.environment("torch"))
    return dict(environment=env, host_ms=host_ms, density=stats.density,
                kernels=[dataclasses.asdict(k) for k in _torch_kernels(tmp / "trace.json", not cuda)])


# -- JAX ---------------------------------------------------------------------------------------
def hlo_sources(text: str) -> dict[str, str]:
    """Optimised HLO text -> {instruction name (dots as underscores): "file:function"} of the line
    each instruction came from (its metadata's stack_frame_id: the innermost frame)."""
    files = {int(i): f for i, f in re.findall(r'^(\d+) "(.*)"$', _section(text, "FileNames"), re.M)}
    functions = {int(i): f for i, f in re.findall(r'^(\d+) "(.*)"$', _section(text, "FunctionNames"), re.M)}
    locations = {int(i): (int(f), int(fn)) for i, f, fn in
                 re.findall(r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+)", _section(text, "FileLocations"),
                            re.M)}
    frames = {int(i): int(loc) for i, loc in
              re.findall(r"^(\d+) \{file_location_id=(\d+)", _section(text, "StackFrames"), re.M)}
    out = {}
    for name, frame in re.findall(r"%([\w.\-]+) = .*?stack_frame_id=(\d+)", text):
        loc = locations.get(frames.get(int(frame), -1))
        if loc is not None:
            out[name.replace(".", "_").replace("-", "_")] = f"{files.get(loc[0], '?')}:{functions.get(loc[1], '?')}"
    return out


def _section(text: str, title: str) -> str:
    m = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
    return "" if m is None else m.group(1)


def _jax_kernels(trace_dir: Path, hlo_dir: Path) -> list[Kernel]:
    lines = device_lines(trace_dir)
    kernels = stream_kernels(lines) if any("/device:" in line for line in lines) else [
        e for evs in device_lines(trace_dir, host=True).values() for e in evs
        if "hlo_op" in e.get("args", {})]   # a CPU: XLA's ops on the host
    modules = [hlo_sources(p.read_text()) for p in hlo_dir.glob("*after_optimizations.txt")]
    key = lambda e: str(e.get("args", {}).get("hlo_op", e["name"])).replace(".", "_").replace("-", "_")  # noqa: E731
    sources = max(modules, key=lambda m: sum(key(e) in m for e in kernels), default={})
    return [Kernel(e["name"], e["ts"], e["dur"], sources.get(key(e))) for e in kernels]


def _jax_worker(spec: dict, tmp: Path) -> dict:
    import jax
    from benchmarks.engine import jax_generate_bench as bench
    import wise_jax
    from wise_core.wise_config import WiseConfig
    config, params, prompts = bench.cohort_setup(dict(spec, seed=0))
    tight = dict(max_model_len=spec["context"] + spec["new_tokens"]) if spec["tight"] else {}
    llm = wise_jax.LLM(params, config, wise_config=WiseConfig() if spec["arm"] == "wise" else None,
                       attention_backend=spec["kernel"], **tight)
    sync = lambda: jax.block_until_ready(llm.cache)  # noqa: E731
    _cohort(llm, prompts, wise_jax.SamplingParams(max_tokens=spec["new_tokens"], ignore_eos=True))
    host_ms = _timed(llm, spec["steps"], sync)
    with jax.profiler.trace(str(tmp / "trace"), create_perfetto_trace=True):
        _timed(llm, spec["steps"], sync)
    env = "jax {jax}; {device}".format(**rp.environment("jax"))
    return dict(environment=env, host_ms=host_ms, density=llm.stats().density,
                kernels=[dataclasses.asdict(k) for k in _jax_kernels(tmp / "trace", tmp / "hlo")])


def worker(spec: dict) -> dict:
    from wise_core.model_config import ModelConfig
    from wise_core.wise_config import WiseConfig
    tmp = Path(spec["tmp"])
    out = (_torch_worker if spec["framework"] == "torch" else _jax_worker)(spec, tmp)
    config = ModelConfig(**spec["config"])
    roles = tuple(WiseConfig().depth_role(loop) for loop in range(config.num_loops))
    kernels, host_ms = [Kernel(**k) for k in out.pop("kernels")], out.pop("host_ms")
    return dict(status="ok", **out, **summarize(kernels, spec["steps"], layers=config.num_hidden_layers, roles=roles,
                                                host_ms=host_ms))


def run(spec: dict, workdir: Path, timeout: float, hlo_out: Path | None = None) -> dict:
    """One (framework, shape, arm) in a fresh process -> its summary (or why there is none); the
    JAX step's optimised HLO gzipped into hlo_out when given."""
    name = f"{spec['framework']}-{spec['context']}x{spec['batch']}-{spec['arm']}"
    tmp = workdir / name
    (tmp / "hlo").mkdir(parents=True)
    spec = dict(spec, tmp=str(tmp), result=str(tmp / "result.json"))
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = rp.module_env(PYTHONUNBUFFERED="1")
    if spec["framework"] == "jax":
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), f"--xla_dump_to={tmp / 'hlo'}",
                                     "--xla_dump_hlo_module_re=.*_step.*"]).strip()
    try:
        done = subprocess.run(rp.module_command("profile.step_profile", "--worker", str(tmp / "spec.json")),
                              env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return dict(status=f"error: timed out after {timeout:.0f} s")
    log = (done.stdout + done.stderr).strip()
    if done.returncode != 0 or not Path(spec["result"]).exists():
        return dict(status=f"error: worker exited {done.returncode}: {log[-1200:]}")
    result = json.loads(Path(spec["result"]).read_text())
    warnings = [line for line in log.splitlines() if "by rematerialization" in line]
    result["remat_warning"] = warnings[0][-300:] if warnings else None
    if hlo_out is not None:
        hlo_out.mkdir(parents=True, exist_ok=True)
        for f in (tmp / "hlo").glob("*after_optimizations.txt"):
            with open(f, "rb") as src, gzip.open(hlo_out / f"{name}.{f.name}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    return result


def markdown(shape: tuple[int, int], rows: list[dict], environment: list[str], date: str) -> str:
    context, batch = shape
    out = [f"# One decode step, {context} x {batch} ({date})", "", "; ".join(sorted(set(environment))), "",
           "ms per step (launches per step). host = host-timed step; host gap = host - kernels.", "",
           "| framework | arm | host ms | kernels ms | host gap | launches | " + " | ".join(CATEGORIES) + " |",
           "|---" * (6 + len(CATEGORIES)) + "|"]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['framework']} | {r['arm']} | `{r['status'][:200]}` |")
            continue
        cells = [f"{r['categories'][c]['ms']:.3f} ({r['categories'][c]['launches']:.0f})" for c in CATEGORIES]
        out.append(f"| {r['framework']} | {r['arm']} | {r['host_ms']:.2f} | {r['kernel_ms']:.2f} | "
                   f"{r['host_gap_ms']:.2f} | {r['launches']} | " + " | ".join(cells) + " |")
    for r in rows:
        if r["status"] == "ok":
            out += ["", f"## {r['framework']} {r['arm']}: density {r.get('density')}; remat warning: "
                    f"{r.get('remat_warning') or 'none'}", "", "| category | kernel | calls | us |", "|---|---|---|---|"]
            out += [f"| {k['category']} | `{k['name']}` | {k['calls']:.0f} | {k['us']:.1f} |" for k in r["top_kernels"]]
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", default="torch,jax")
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--q-scale", type=parse_floats, default=[8.0], help="one value, or one per shape")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1024x64,1024x1"))
    p.add_argument("--arms", default="dense,wise")
    p.add_argument("--steps", type=int, default=4, help="steps timed, then as many profiled")
    p.add_argument("--tight", action="store_true", help="max_model_len = context + steps (default: the defaults)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--kernel", default="auto", help="the engines' attention_backend (auto: their default)")
    p.add_argument("--child-timeout", type=float, default=300)
    p.add_argument("--keep-hlo", action="store_true", help="keep the JAX decode step's optimised HLO (gzipped)")
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        try:
            result = worker(spec)
        except Exception as e:  # reported in the row; the others go on
            traceback.print_exc()
            result = dict(status=f"error: {type(e).__name__}: {e}"[:800])
        Path(spec["result"]).write_text(json.dumps(result))
        return result
    if args.out is None:
        p.error("--out is required")
    from wise_core.presets import PRESETS
    config = dataclasses.replace(PRESETS[args.preset], eos_token_id=None)
    scales = args.q_scale * len(args.shapes) if len(args.q_scale) == 1 else args.q_scale
    if len(scales) != len(args.shapes):
        p.error(f"--q-scale gives {len(args.q_scale)} values for {len(args.shapes)} shapes")
    frameworks, arms = args.frameworks.split(","), args.arms.split(",")
    if set(frameworks) - {"torch", "jax"} or set(arms) - {"dense", "wise"}:
        p.error("--frameworks takes torch,jax and --arms dense,wise")
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    date = rp.now()
    workdir = Path(tempfile.mkdtemp(prefix="wise-step-profile-"))
    report = dict(date=date, args={k: str(v) for k, v in vars(args).items()}, shapes={})
    try:
        for (context, batch), q_scale in zip(args.shapes, scales):
            rows = []
            for framework in frameworks:
                for arm in arms:
                    spec = dict(framework=framework, arm=arm, context=context, batch=batch, q_scale=q_scale,
                                config=dataclasses.asdict(config), std=args.std, dtype=args.dtype, device=device,
                                kernel=args.kernel, steps=args.steps, tight=args.tight,
                                new_tokens=4 * args.steps + 16)
                    hlo = args.out / f"{context}x{batch}" / "hlo" if args.keep_hlo and framework == "jax" else None
                    result = run(spec, workdir, args.child_timeout, hlo)
                    rows.append(dict(framework=framework, arm=arm, q_scale=q_scale, **result))
                    print(f"{context} x {batch} {framework} {arm}: {result['status']}" +
                          (f", host {result['host_ms']:.2f} ms, kernels {result['kernel_ms']:.2f} ms"
                           if result["status"] == "ok" else ""), flush=True)
            report["shapes"][f"{context}x{batch}"] = rows
            rp.write_report(args.out / f"{context}x{batch}", "step_profile",
                            dict(date=date, args=report["args"], rows=rows),
                            markdown((context, batch), rows, [r.get("environment", "") for r in rows], date))
        return report
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
