"""The report: a text table of results, and the JSON record (results, machine, versions, date)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

COLUMNS = ("check", "implementation", "case", "dtype", "measured", "bound", "unit", "status")


def _number(x: float | None) -> str:
    if x is None:
        return "-"
    if float(x).is_integer() and abs(x) < 1e6:
        return str(int(x))
    return f"{x:.3g}"


def table(results, *, details: str = "failures") -> str:
    """Aligned text table; details: 'failures' (detail lines under FAIL/skip rows), 'all' or 'none'."""
    rows = [COLUMNS] + [(r.check, r.impl, r.case, r.dtype, _number(r.measured), _number(r.bound), r.unit or "-",
                         r.status) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
            continue
        result = results[n - 1]
        if result.detail and (details == "all" or (details == "failures" and result.status != "pass")):
            lines.append(f"    {result.detail}")
    return "\n".join(lines)


def summary(results) -> str:
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "FAIL", "skip")}
    return f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped"


def versions() -> dict[str, str | None]:
    """Versions of Python and of the packages the suite exercises (None when absent)."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for package in ("numpy", "torch", "triton", "jax", "jaxlib", "wise"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def machine(settings) -> dict:
    """Host, CPU, accelerators and the devices each framework ran on."""
    import jax
    import torch

    info = {"host": platform.node(), "platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "torch_device": settings.device, "jax_backend": jax.default_backend(),
            "jax_devices": [str(d) for d in jax.devices()],
            "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def record(results, settings, unavailable: dict[str, str], seconds: float, complete: bool = True) -> dict:
    """The JSON-able record of a run (complete: every requested check ran)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": settings.quick, "complete": complete, "seconds": round(seconds, 2), "machine": machine(settings),
        "versions": versions(), "unavailable_implementations": unavailable,
        "passed": all(r.passed is not False for r in results), "summary": summary(results),
        "results": [dataclasses.asdict(r) | {"status": r.status} for r in results],
    }


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")
    return path
