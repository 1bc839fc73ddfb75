"""What every benchmark writes: markdown tables, the report as JSON and markdown (and a PNG),
the machine it ran on, and the command line of a worker process."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent  # the repository
RESULTS = ROOT / "benchmarks" / "results"  # where reports are kept (each run in a folder of its own)


def now() -> str:
    """The local time to the second, as reports date themselves."""
    return datetime.datetime.now().isoformat(timespec="seconds")


def fmt(value, spec: str = ".1f") -> str:
    """value formatted by spec; "-" for None or NaN."""
    return "-" if value is None or value != value else format(value, spec)


def table(header: list[str], rows) -> list[str]:
    """A markdown table's lines: the header, its rule, then one line per row (cells as str)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def version(package: str) -> str | None:
    """An installed distribution's version, or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(*frameworks: str) -> dict:
    """The machine and the versions a report names: host, python, cpu, and per framework
    ("torch": torch, triton, cuda and the CUDA device or "cpu"; "jax": jax, jaxlib, the default
    device, XLA_FLAGS). The framework is imported here (call it where the run imports it)."""
    env = dict(host=platform.node(), python=platform.python_version(),
               cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count())
    if "torch" in frameworks:
        import torch
        env.update(torch=torch.__version__, triton=version("triton"), cuda=torch.version.cuda,
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    if "jax" in frameworks:
        import jax
        device = jax.devices()[0]
        env.update(jax=jax.__version__, jaxlib=version("jaxlib"),
                   device=f"{device.platform}: {getattr(device, 'device_kind', device)}",
                   xla_flags=os.environ.get("XLA_FLAGS", ""))
    return env


def write_json(path: Path, data, indent: int = 1) -> None:
    """data as JSON (what json cannot encode as str), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str) + "\n")


def write_report(out: Path, stem: str, data, text: str,
                 plot: Callable[[Path], None] | None = None) -> str:
    """out/STEM.json (data), out/STEM.md (text) and, given plot, out/STEM.png (plot(path)).
    Returns text."""
    write_json(out / f"{stem}.json", data)
    (out / f"{stem}.md").write_text(text)
    if plot is not None:
        plot(out / f"{stem}.png")
    return text


def pyplot():
    """matplotlib.pyplot on the file-only backend (no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_png(fig, path: Path, dpi: int = 110) -> None:
    """Write a figure as a PNG and close it."""
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def module_command(module: str, *args: str) -> list[str]:
    """`python -m benchmarks.MODULE ARGS` (MODULE below `benchmarks`, e.g. "engine.throughput"): a
    worker process of a benchmark. Run it with `module_env` (the repository on its path) from a
    folder outside the repository when `first` must win over the repository's packages (`python
    -m` puts the working folder first)."""
    return [sys.executable, "-m", f"benchmarks.{module}", *args]


def module_env(first: str | None = None, **extra: str) -> dict:
    """os.environ with PYTHONPATH = [first,] the repository, then what it held; plus extra."""
    paths = [p for p in (first, str(ROOT), os.environ.get("PYTHONPATH")) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **extra)


def run_worker(module: str, spec: dict, timeout: float, **env: str) -> dict:
    """Run `python -m benchmarks.MODULE --worker JSON(spec)` (`module_env` with env) -> the JSON
    object its last line of output prints, or {"error": the end of its output} if it failed."""
    done = subprocess.run(module_command(module, "--worker", json.dumps(spec)), env=module_env(**env),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        return dict(error=(done.stdout + done.stderr)[-1500:])
    return json.loads(done.stdout.strip().splitlines()[-1])
