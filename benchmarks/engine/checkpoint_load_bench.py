"""Checkpoint loading: wall time and peak host memory of `wise_torch.load_model` and
`wise_jax.load_model` on an Ouro-1.4B-shaped bf16 checkpoint in two shards (2.87 GB).

    python -m benchmarks.engine.checkpoint_load_bench --out benchmarks/results/cpu-2026-12-01
    python -m benchmarks.engine.checkpoint_load_bench --smoke --out /tmp/clb     # tiny model, seconds

The checkpoint (random bf16 weights, `--dir`, written once and reused) is loaded into bf16 on
the CPU, each load in a fresh process: time is `load_model` alone (imports excluded), peak RSS
is the process's high-water mark (VmHWM; ru_maxrss would count the parent's memory at fork),
and the RSS after the imports is shown beside it. `--baseline PATH` also loads with the wise checkout at PATH (the
same measurement of another version). Page cache: the files are read once before timing, so
every load reads them from memory. Targets: peak RSS <= 1.3 x the checkpoint's bytes and
<= 6 s per framework.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import report as rp

TARGET_RATIO = 1.3
TARGET_SECONDS = 6.0

CHILD = r"""
import json, sys, time
framework, directory = sys.argv[1], sys.argv[2]
if framework == "torch":
    import torch, wise_torch
    load = lambda: wise_torch.load_model(directory, dtype=torch.bfloat16)
    leaves = lambda m: list(m.state_dict().values())
    touch = lambda x: float(x.reshape(-1)[::2048].float().sum())
else:
    import jax, jax.numpy as jnp, wise_jax
    jnp.zeros(1).block_until_ready()  # start the runtime before the baseline
    load = lambda: wise_jax.load_model(directory, dtype=jnp.bfloat16)[1]
    leaves = lambda p: [x.block_until_ready() for x in jax.tree.leaves(p)]
    touch = lambda x: None  # JAX params are device arrays, resident when load_model returns
def status_mb(field):  # VmRSS now, VmHWM the high-water mark of this process image (not the parent's)
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) / 1024
baseline = status_mb("VmRSS")
start = time.perf_counter()
model = load()
params = leaves(model)
seconds = time.perf_counter() - start
peak = status_mb("VmHWM")
for x in params:  # one value per 4 KB page (bf16): memory-mapped weights become resident
    touch(x)
print(json.dumps({"seconds": seconds, "baseline_mb": baseline, "peak_mb": peak,
                  "resident_peak_mb": status_mb("VmHWM"),
                  "param_bytes": sum(x.nbytes for x in params),
                  "dtypes": sorted({str(x.dtype) for x in params})}))
"""


def write_checkpoint(directory: Path, smoke: bool) -> int:
    """Random bf16 weights of Ouro-1.4B's shapes (smoke: a tiny config) in two shards; returns
    the bytes of the weight files."""
    import dataclasses as dc

    import ml_dtypes
    import numpy as np

    from wise_core.checkpoint import Checkpoint, expected_shapes, save_checkpoint
    from wise_core.presets import PRESETS

    config = PRESETS["ouro-1.4b"]
    if smoke:
        config = dc.replace(PRESETS["test-tiny"], vocab_size=512, num_hidden_layers=4)
    rng = np.random.default_rng(0)
    tensors = {name: (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
               for name, shape in expected_shapes(config).items()}
    total = sum(t.nbytes for t in tensors.values())
    save_checkpoint(directory, Checkpoint(config, tensors), bf16=True, max_shard_bytes=int(total * 0.55))
    return weight_bytes(directory)


def weight_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def measure(source: Path, framework: str, directory: Path) -> dict:
    # run in the checkout: `python -c` puts its working folder first on the path
    out = subprocess.run([sys.executable, "-c", CHILD, framework, str(directory)], cwd=source,
                         capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if out.returncode:
        raise RuntimeError(f"{framework} load failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@dataclasses.dataclass
class Row:
    version: str
    framework: str
    seconds: float          # median of the repeats
    seconds_all: list[float]
    peak_mb: float          # max over the repeats, at the end of load_model
    resident_peak_mb: float  # max over the repeats, once every weight page was read
    baseline_mb: float
    ratio: float            # peak / checkpoint bytes
    param_bytes: int
    dtypes: list[str]


def versions() -> dict:
    return {"python": platform.python_version(),
            **{p: rp.version(p) for p in ("numpy", "torch", "jax", "jaxlib", "safetensors", "ml_dtypes")}}


def markdown(rows: list[Row], size: int, info: dict) -> str:
    lines = [f"# Checkpoint loading, {info['date']}", "",
             f"{info['checkpoint']}: {size / 1e9:.2f} GB of bf16 weights in two shards, loaded into bf16 on "
             f"the CPU ({info['cpu']}, {info['cpu_count']} cores); one fresh process per load, "
             f"{info['repeats']} loads each, page cache warm; 1-minute load average "
             f"{min(info['load_average_1min']):.1f}-{max(info['load_average_1min']):.1f} during the run "
             f"(other jobs share this machine: repeats of one load differ by up to "
             f"{max(max(r.seconds_all) / min(r.seconds_all) for r in rows):.1f}x). Targets: peak RSS <= {TARGET_RATIO} x "
             f"checkpoint ({TARGET_RATIO * size / 2**20:.0f} MB), <= {TARGET_SECONDS} s.", "",
             "| version | framework | load s (median) | peak RSS MB | after imports MB | peak / checkpoint | "
             "peak once resident MB | time target | memory target |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.version} | {r.framework} | {r.seconds:.2f} | {r.peak_mb:.0f} | {r.baseline_mb:.0f} | "
                     f"{r.ratio:.2f} | {r.resident_peak_mb:.0f} | {'pass' if r.seconds <= TARGET_SECONDS else 'FAIL'} | "
                     f"{'pass' if r.ratio <= TARGET_RATIO else 'FAIL'} |")
    lines += ["", "Peak RSS is measured when load_model returns; torch's weights are memory-mapped "
              "(safetensors), so they become resident, as file-backed pages, on first use: the "
              "'once resident' column reads one value per page of every torch weight first (JAX "
              "params are resident on return). JAX's time goes to transposing every linear weight "
              "to the [in, out] layout of wise_jax.params on the host (about 2.5 GB here)."]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for checkpoint_load.{json,md}")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/wise-ouro-1.4b-bf16"),
                        help="the checkpoint (written when absent)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="also measure the wise checkout at this path")
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint (tests)")
    args = parser.parse_args(argv)
    if not (args.dir / "config.json").exists():
        print(f"writing the checkpoint to {args.dir} ...", file=sys.stderr)
        write_checkpoint(args.dir, args.smoke)
    size = weight_bytes(args.dir)
    for path in args.dir.glob("*.safetensors"):  # warm the page cache
        with open(path, "rb") as f:
            while f.read(1 << 26):
                pass
    sources = [("this", rp.ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    rows, load = [], [os.getloadavg()[0]]
    for version, source in sources:
        for framework in ("torch", "jax"):
            runs = [measure(source, framework, args.dir) for _ in range(args.repeats)]
            seconds = [r["seconds"] for r in runs]
            peak = max(r["peak_mb"] for r in runs)
            rows.append(Row(version, framework, statistics.median(seconds), seconds, peak,
                            max(r["resident_peak_mb"] for r in runs),
                            statistics.median(r["baseline_mb"] for r in runs), peak * 2**20 / size,
                            runs[0]["param_bytes"], runs[0]["dtypes"]))
            load.append(os.getloadavg()[0])
            print(f"{version} {framework}: {rows[-1].seconds:.2f} s, peak {peak:.0f} MB "
                  f"({rows[-1].ratio:.2f} x checkpoint)", file=sys.stderr)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "checkpoint": "smoke" if args.smoke else "Ouro-1.4B shapes", "checkpoint_bytes": size,
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "repeats": args.repeats, "versions": versions(), "load_average_1min": [round(x, 2) for x in load],
            "baseline": str(args.baseline) if args.baseline else None,
            "targets": {"peak_over_checkpoint": TARGET_RATIO, "seconds": TARGET_SECONDS}}
    rp.write_report(args.out, "checkpoint_load", {**info, "rows": [dataclasses.asdict(r) for r in rows]},
                    markdown(rows, size, info))
    print(f"wrote {args.out}/checkpoint_load.{{json,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
