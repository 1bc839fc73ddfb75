"""benchmarks/kernels/kernel_bench.py --smoke: every code path of the H200 benchmark at tiny shapes on CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the full benchmark")


def _load():
    from benchmarks.kernels import kernel_bench
    return kernel_bench


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


def test_pallas_rows_best_kernel_and_comparison():
    """The faster Pallas kernel per (shape, mode, density) is 'pallas-best'; the comparison with
    Triton and the Pallas targets read it (rows of the shape bench_pallas returns)."""
    bench = _load()

    def row(impl, mode, density, us):
        return dict(impl=impl, mode=mode, ctx=1024, batch=64, density=density, us=us, tbps=1.0, config=impl)

    rows = [row("triton", "dense", 1.0, 100.0), row("pallas", "dense", 1.0, 110.0),
            row("mosaic", "dense", 1.0, 90.0), row("triton", "sparse", 0.13, 30.0),
            row("pallas", "sparse", 0.13, 29.0), row("mosaic", "sparse", 0.13, float("nan")),
            row("sdpa-cudnn", "dense", 1.0, 95.0), row("sdpa-cudnn", "contiguous", 0.13, 25.0)]
    best = {(r["mode"], r["density"]): r for r in bench.best_pallas_rows(rows)}
    assert best["dense", 1.0]["us"] == 90.0 and best["dense", 1.0]["config"].startswith("mosaic")
    assert best["sparse", 0.13]["us"] == 29.0 and best["sparse", 0.13]["config"].startswith("pallas")
    rows += list(best.values())
    compared = {(e["mode"], e["density"]): e for e in bench.pallas_against_triton(rows, [(1024, 64)])}
    assert compared["dense", 1.0]["pallas_vs_triton"] == pytest.approx(1.1)
    assert compared["dense", 1.0]["mosaic_vs_triton"] == pytest.approx(0.9)
    assert compared["sparse", 0.13]["mosaic_vs_triton"] is None  # a failed case has no ratio
    standing = {t["target"]: t for t in bench.standing(rows, [(1024, 64)])}
    assert standing["better Pallas dense <= 1.00x Triton"]["passed"] is True
    assert standing["better Pallas sparse @0.13 <= 1.10x cuDNN SDPA @0.13 contiguous"]["ratio"] == pytest.approx(29 / 25)
    assert standing["better Pallas sparse @0.13 <= 1.10x cuDNN SDPA @0.13 contiguous"]["passed"] is False
    assert standing["better Pallas discover <= 1.00x Triton"]["passed"] is None  # not measured


def test_refuses_a_bad_mosaic_config(capsys):
    with pytest.raises(SystemExit):
        _load().main(["--smoke", "--mosaic-config", "split_keys=1000"])
    assert "MosaicConfig.split_keys must be a positive power of two" in capsys.readouterr().err
