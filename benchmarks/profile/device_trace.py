"""Device activity from a jax.profiler perfetto trace: kernel time per trace line, per kernel
name and per group, and the span (first kernel's start to last kernel's end), per step.
Shared by step_profile.py, kernel_profile.py and bench_pallas.py."""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path

GROUPS = (("gemm", ("gemm", "nvjet", "cutlass", "cublas", "xmma", "matmul", "dot")),
          ("attention", ("pallas", "mosaic", "decode", "split", "finish", "select", "attention")),
          ("copy", ("copy", "memcpy", "memset", "dynamic-slice", "dynamic_slice", "dynamic-update", "scatter",
                    "gather")),
          ("fusion", ("fusion",)))


def group_of(name: str) -> str:
    lower = name.lower()
    for group, keys in GROUPS:
        if any(k in lower for k in keys):
            return group
    return "other"


def device_lines(trace_dir: Path, *, host: bool = False) -> dict[str, list[dict]]:
    """The device events ("X") of the perfetto trace under trace_dir (with host=True, the host's
    too), per trace line ("process | thread"), each line in trace order."""
    files = list(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    events = json.load(gzip.open(files[0]))["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    devices = ({pid for pid, name in processes.items() if "/device:" in name}
               or {pid for pid, name in processes.items() if not name.startswith("/host:")})
    lines: dict[str, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and (host or e["pid"] in devices):
            lines[f"{processes[e['pid']]} | {threads.get((e['pid'], e['tid']), e['tid'])}"].append(e)
    return dict(lines)


def stream_kernels(lines: dict[str, list[dict]]) -> list[dict]:
    """The kernels of `device_lines`: the events of its stream lines (every line if none is one)."""
    streams = [line for line in lines if "stream" in line.lower()] or list(lines)
    return [e for line in streams for e in lines[line]]


def device_activity(trace_dir: Path, steps: int) -> dict:
    """Per-step device times (us) from the perfetto trace under trace_dir: per trace line
    (events, busy), per kernel name on the busiest line kind, per group, and the span."""
    lines = device_lines(trace_dir)
    out = dict(lines={}, kernels={}, groups={}, span_us=None, busy_us=None)
    for line, evs in lines.items():
        out["lines"][line] = dict(events_per_step=len(evs) / steps, busy_us=sum(e["dur"] for e in evs) / steps)
    kernels = stream_kernels(lines)
    if kernels:
        by_name: dict[str, list[float]] = collections.defaultdict(list)
        for e in kernels:
            by_name[e["name"]].append(e["dur"])
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
        out["kernels"] = {name: dict(calls_per_step=len(d) / steps, us_per_step=sum(d) / steps) for name, d in top[:40]}
        groups: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for name, d in by_name.items():
            g = groups[group_of(name)]
            g[0] += len(d)
            g[1] += sum(d)
        out["groups"] = {g: dict(calls_per_step=c / steps, us_per_step=t / steps) for g, (c, t) in groups.items()}
        out["busy_us"] = sum(e["dur"] for e in kernels) / steps
        out["span_us"] = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / steps
    return out
