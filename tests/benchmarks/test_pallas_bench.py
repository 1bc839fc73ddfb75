"""benchmarks/kernels/bench_pallas.py runs every case of both Pallas kernels at a tiny shape in the
interpreters (CPU)."""

from __future__ import annotations

import math

import jax.numpy as jnp

from benchmarks.kernels.bench_pallas import SWEEP_DENSITY, bench_pallas
from wise_jax.kernels.mosaic_decode import MosaicConfig


def test_bench_pallas_rows():
    rows = bench_pallas(((128, 2),), (0.5,), heads=2, head_dim=64, page_size=32, interpret=True,
                        chain=(1, 2), repeats=1)
    assert [r.get("error") for r in rows] == [None] * len(rows)
    keys = {"impl", "mode", "ctx", "batch", "density", "us", "tbps", "config"}
    assert all(keys <= set(r) for r in rows)
    modes = (("dense", 1.0), ("discover", 1.0), ("sparse", 0.5), ("sparse-contiguous", 0.5),
             ("discover+sparse", 0.5))
    assert [(r["impl"], r["mode"], r["density"]) for r in rows] == [
        ("pallas", mode, density) for mode, density in modes] + [
        ("mosaic", mode, density) for mode, density in modes + (("sparse-plain", 0.5),)] + [
        ("jax-paged", "dense", 1.0), ("jax-paged", "contiguous", 0.13)]
    assert rows[5]["config"].startswith("MosaicConfig(")
    assert all(r["ctx"] == 128 and r["batch"] == 2 and math.isfinite(r["us"]) for r in rows)
    assert rows[-1]["config"].startswith("k_splits=")


def test_named_mosaic_configs_are_timed_whatever_the_sweep_budget():
    """kernel_bench passes a sweep budget of 0 when it does not sweep; configs named by
    --mosaic-config are not a sweep and are each timed (dense and sparse)."""
    named = MosaicConfig(tile_n=64, split_keys=128, num_stages=1)
    rows = bench_pallas(((128, 2),), (SWEEP_DENSITY,), heads=2, head_dim=64, page_size=32,
                        interpret=True, chain=(1, 2), repeats=1, impls=("mosaic",), sweep_seconds=0.0,
                        jax_paged=False, mosaic_configs=(named,))
    assert [(r["impl"], r["mode"], r.get("error")) for r in rows if r["impl"] == "mosaic-config"] \
        == [("mosaic-config", "dense", None), ("mosaic-config", "sparse", None)]
    assert all(r["config"] == str(named) for r in rows if r["impl"] == "mosaic-config")


def test_kernel_profile_smoke(tmp_path):
    """kernel_profile.py runs every case at a tiny shape in the interpreters (no device kernels
    on a CPU: busy and span are None), the Mosaic kernel with the launch asked for, and writes
    its report."""
    import json
    from benchmarks.profile import kernel_profile
    report = kernel_profile.main(["--smoke", "--out", str(tmp_path), "--calls", "2",
                                  "--modes", "dense,sparse",
                                  "--mosaic-config", "min_splits=2,num_stages=1"])
    assert [(r["impl"], r["mode"], r.get("error")) for r in report["rows"]] == [
        (impl, mode, None) for impl in ("pallas", "mosaic") for mode in ("dense", "sparse")]
    assert all(r["busy_us"] is None and r["span_us"] is None for r in report["rows"])
    assert json.loads((tmp_path / "kernel_profile.json").read_text())["rows"] == report["rows"]
    text = (tmp_path / "kernel_profile.md").read_text()
    assert "| 128 x 2 | mosaic | sparse | n/a | n/a |" in text
    assert "min_splits=2" in text


def test_parse_mosaic_config():
    """--mosaic-config's NAME=VALUE items become a MosaicConfig; bad items are refused by name."""
    import pytest
    from benchmarks.kernels.bench_pallas import parse_mosaic_config
    from wise_jax.kernels.mosaic_decode import MosaicConfig
    assert parse_mosaic_config("split_keys=2048,min_splits=2,products=reduce,list_launch=True") \
        == MosaicConfig(split_keys=2048, min_splits=2, products="reduce", list_launch=True)
    assert parse_mosaic_config("") == MosaicConfig()
    with pytest.raises(ValueError, match="tile"):
        parse_mosaic_config("tiles=64")
    with pytest.raises(ValueError, match="MosaicConfig.list_launch must be a bool"):
        parse_mosaic_config("list_launch=yes")
    with pytest.raises(ValueError, match="MosaicConfig.products must be one of"):
        parse_mosaic_config("products=dots")
    with pytest.raises(ValueError, match="power of two"):
        parse_mosaic_config("split_keys=1000")


def test_mosaic_call_runs_in_the_interpreter():
    """mosaic_call.py (the Nsight Compute target) runs its call at a tiny shape on a CPU."""
    from benchmarks.kernels import mosaic_call
    out = mosaic_call.main(["--shape", "128x2", "--heads", "2", "--head-dim", "64",
                            "--page-size", "32", "--calls", "1", "--density", "0.5"])
    assert out.shape == (2, 2, 64) and bool(jnp.isfinite(out.astype(jnp.float32)).all())


def test_mosaic_call_refuses_bad_arguments(capsys):
    """mosaic_call.py names a bad shape, call count or config instead of running."""
    import pytest
    from benchmarks.kernels import mosaic_call
    for argv, message in ((["--shape", "40x"], "--shape takes CTXxBATCH"),
                          (["--calls", "0"], "--calls must be at least 1"),
                          (["--config", "split_keys=1000"], "power of two")):
        with pytest.raises(SystemExit):
            mosaic_call.main(argv)
        assert message in capsys.readouterr().err


def test_support_random_and_contiguous():
    """bench_pallas's supports: round(density * blocks) blocks per row and head, random ones
    (differing between heads) or, for sparse-contiguous, the first ones for every head."""
    import numpy as np
    from benchmarks.kernels.bench_pallas import support_of
    random = np.asarray(support_of(2, 4, 40, 0.25))
    contiguous = np.asarray(support_of(2, 4, 40, 0.25, contiguous=True))
    assert (random.sum(-1) == 10).all() and (contiguous.sum(-1) == 10).all()
    assert (contiguous == (np.arange(40) < 10)).all()
    assert len({tuple(row) for row in random.reshape(-1, 40)}) > 1
    assert np.asarray(support_of(2, 4, 40, None)).all()


def test_l2_floor_arguments():
    """benchmarks/kernels/l2_floor.py needs sm90 (Mosaic GPU) to mean anything: its arguments only."""
    from benchmarks.kernels import l2_floor
    args = l2_floor.build_parser().parse_args(["--shapes", "4096x20", "--stages", "2,3"])
    assert args.shapes == [(4096, 20)] and args.stages == "2,3" and args.density == 0.13
