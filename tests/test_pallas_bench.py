"""benchmarks/bench_pallas.py runs every case of both Pallas kernels at a tiny shape in the
interpreters (CPU)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_pallas import bench_pallas  # noqa: E402


def test_bench_pallas_rows():
    rows = bench_pallas(((128, 2),), (0.5,), heads=2, head_dim=64, page_size=32, interpret=True,
                        chain=(1, 2), repeats=1)
    assert [r.get("error") for r in rows] == [None] * len(rows)
    keys = {"impl", "mode", "ctx", "batch", "density", "us", "tbps", "config"}
    assert all(keys <= set(r) for r in rows)
    assert [(r["impl"], r["mode"], r["density"]) for r in rows] == [
        (impl, mode, density) for impl in ("pallas", "mosaic")
        for mode, density in (("dense", 1.0), ("discover", 1.0), ("sparse", 0.5),
                              ("discover+sparse", 0.5))] + [
        ("jax-paged", "dense", 1.0), ("jax-paged", "contiguous", 0.13)]
    assert rows[4]["config"].startswith("MosaicConfig(")
    assert all(r["ctx"] == 128 and r["batch"] == 2 and math.isfinite(r["us"]) for r in rows)
    assert rows[-1]["config"].startswith("k_splits=")


def test_kernel_profile_smoke(tmp_path):
    """kernel_profile.py runs every case at a tiny shape in the interpreters (no device kernels
    on a CPU: busy and span are None) and writes its report."""
    import json
    import kernel_profile
    report = kernel_profile.main(["--smoke", "--out", str(tmp_path), "--calls", "2",
                                  "--modes", "dense,sparse"])
    assert [(r["impl"], r["mode"], r.get("error")) for r in report["rows"]] == [
        (impl, mode, None) for impl in ("pallas", "mosaic") for mode in ("dense", "sparse")]
    assert all(r["busy_us"] is None and r["span_us"] is None for r in report["rows"])
    assert json.loads((tmp_path / "kernel_profile.json").read_text())["rows"] == report["rows"]
    assert "| 128 x 2 | mosaic | sparse | n/a | n/a |" in (tmp_path / "kernel_profile.md").read_text()
