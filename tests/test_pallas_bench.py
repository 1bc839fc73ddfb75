"""benchmarks/bench_pallas.py runs every case at a tiny shape in interpret mode (CPU)."""

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
        ("pallas", "dense", 1.0), ("pallas", "discover", 1.0), ("pallas", "sparse", 0.5),
        ("pallas", "discover+sparse", 0.5), ("jax-paged", "dense", 1.0),
        ("jax-paged", "contiguous", 0.13)]
    assert all(r["ctx"] == 128 and r["batch"] == 2 and math.isfinite(r["us"]) for r in rows)
    assert rows[-1]["config"].startswith("k_splits=")
