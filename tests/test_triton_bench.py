"""benchmarks/kernel_bench.py --smoke: every code path of the H200 benchmark at tiny shapes on CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_bench.py"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the full benchmark")


def _load():
    spec = importlib.util.spec_from_file_location("kernel_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_a_complete_report(tmp_path):
    bench = _load()
    report = bench.main(["--smoke", "--out", str(tmp_path)])
    for name in ("kernel_bench.json", "kernel_bench.md", "kernel_bench.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "kernel_bench.json").read_text())["rows"] == json.loads(json.dumps(report["rows"]))

    rows = report["rows"]
    assert all({"impl", "mode", "ctx", "batch", "density", "us", "tbps"} <= set(r) for r in rows)
    failed = [r for r in rows if "error" in r]
    assert not failed, failed
    shapes = bench.SMOKE["shapes"]
    triton_modes = {"dense", "discover", "sparse", "sparse-contiguous", "discover+sparse"}
    for ctx, batch in shapes:
        here = [r for r in rows if (r["ctx"], r["batch"]) == (ctx, batch)]
        assert {r["mode"] for r in here if r["impl"] == "triton"} == triton_modes
        assert {r["density"] for r in here if r["mode"] == "sparse" and r["impl"] == "triton"} == set(bench.DENSITIES)
        assert {r["mode"] for r in here if r["impl"] == "triton-config"} == {"dense", "sparse"}
        assert {r["mode"] for r in here if r["impl"] == "sdpa-cpu"} == {"dense", "contiguous"}
        assert all(math.isfinite(r["tbps"]) for r in here)  # a measured time (0 or NaN is not)
        checks = report["checks"][f"{ctx}x{batch}"]
        assert checks["discover_bitwise_dense"] and checks["sparse_all_blocks_bitwise_dense"]
        assert checks["dense_max_abs_err_vs_sdpa"] < 2e-2

    # The attended bytes: dense reads every key of every head; sparse at density 1.0 the same.
    ctx, batch = shapes[0]
    dense = next(r for r in rows if (r["impl"], r["mode"], r["ctx"]) == ("triton", "dense", ctx))
    kv_bytes = 2 * batch * ctx * bench.SMOKE["heads"] * bench.SMOKE["head_dim"] * 2
    assert dense["tbps"] * dense["us"] * 1e6 == pytest.approx(kv_bytes)

    assert len(report["standing"]) == len(bench.TARGETS) * len(shapes)
    discover = [t for t in report["standing"] if t["target"].startswith("discover <=")]
    assert all(t["ratio"] is not None for t in discover)  # triton against triton: measured on CPU too
    # The sweep's verdict: the fastest configuration per shape and mode, and across shapes.
    best = report["best_configs"]
    assert {(b["ctx"], b["batch"], b["mode"]) for b in best["per_shape"]} == {
        (ctx, batch, mode) for ctx, batch in shapes for mode in ("dense", "sparse")}
    for b in best["per_shape"]:
        times = [r["us"] for r in rows if r["impl"] in ("triton", "triton-config") and r["mode"] == b["mode"]
                 and (r["ctx"], r["batch"]) == (b["ctx"], b["batch"])
                 and math.isclose(r["density"], 1.0 if b["mode"] == "dense" else bench.TARGET_DENSITY)]
        assert len(times) == 3 and b["us"] == min(times)  # the table's and two sweep configurations
    assert {o["mode"] for o in best["overall"]} == {"dense", "sparse"}
    assert all(o["geomean_slowdown"] >= 1.0 for o in best["overall"])
    text = (tmp_path / "kernel_bench.md").read_text()
    assert "## Targets" in text and "FA4 skipped" in text and "## Launch configurations" in text
