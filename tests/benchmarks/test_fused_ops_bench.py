"""benchmarks/kernels/fused_ops_bench.py --smoke: every code path of the H200 micro-benchmark at tiny shapes on CPU."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the full benchmark")


def _load():
    from benchmarks.kernels import fused_ops_bench  # TRITON_INTERPRET is set (conftest) before triton loads
    return fused_ops_bench


def test_smoke_run_writes_a_complete_report(tmp_path):
    bench = _load()
    report = bench.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "fused_ops_bench.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    text = (tmp_path / "fused_ops_bench.md").read_text()
    assert "| rope_store_kv |" in text and "## One decode step" in text

    rows = report["rows"]
    assert not [r for r in rows if "error" in r]
    assert {(r["op"], r["tokens"]) for r in rows} == {(op, n) for op in bench.OPS for n in bench.SMOKE_BATCHES}
    for r in rows:
        assert r["chain_us"] > 0 and r["fused_us"] > 0 and r["fused_gbps"] > 0
        assert r["chain_timing"] == r["fused_timing"] == "eager"
        # bf16: rope bitwise; the norms and silu within their documented 2 ulp (interpreter's exp).
        assert r["check"]["bitwise"] if r["op"] == "rope_store_kv" else r["check"]["max_ulp"] <= 2, r
    steps = report["per_step"]
    assert [s["tokens"] for s in steps] == list(bench.SMOKE_BATCHES)
    planes = bench.SMOKE["layers"] * bench.SMOKE["loops"]
    one = {r["op"]: r for r in rows if r["tokens"] == 1}
    expected = (one["rms_norm"]["fused_us"] + planes * (one["rope_store_kv"]["fused_us"] + one["silu_mul"]["fused_us"])
                + (2 * planes - bench.SMOKE["loops"]) * one["add_rms_norm"]["fused_us"]
                + bench.SMOKE["loops"] * one["add_rms_norm+final"]["fused_us"]) / 1e3
    assert steps[0]["fused_ms"] == pytest.approx(expected)
    assert bench.Inputs(bench.OURO, 64, torch.bfloat16, "cpu").bytes_moved("silu_mul") == 3 * 64 * 5632 * 2


def test_token_counts_are_checked():
    bench = _load()
    assert bench.parse_ints("1,10,64") == (1, 10, 64)
    for bad in ("0,1", "a", ""):
        with pytest.raises(Exception, match="token counts|not a comma"):
            bench.parse_ints(bad)
