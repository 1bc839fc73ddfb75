"""benchmarks/engine/tp_scaling.py on CPU: arguments, the per-GPU roofline, the speedup arithmetic, and one
arm end to end on 1 and 2 ranks (fresh processes; the 2-rank engine over gloo)."""

from __future__ import annotations

import pytest

from benchmarks.engine import tp_scaling as ts


def test_arguments_and_per_gpu_roofline():
    assert ts.parse_sizes("1,2") == [1, 2] and ts.parse_arms("wise") == ["wise"]
    for parse, bad in ((ts.parse_sizes, "2"), (ts.parse_sizes, "1,1"), (ts.parse_sizes, "1,x"),
                       (ts.parse_arms, "fa4"), (ts.parse_arms, "dense,dense")):
        with pytest.raises(Exception):
            parse(bad)
    from wise_core.presets import PRESETS
    ouro = PRESETS["ouro-1.4b"]
    one = ts.per_gpu_roofline(ouro, 1, "bfloat16", 8192, 20, 32, None, 4.3)
    two = ts.per_gpu_roofline(ouro, 2, "bfloat16", 8192, 20, 32, None, 4.3)
    # Each of 2 GPUs reads half the K/V and layer weights, and the whole (replicated) LM head.
    head = 49152 * 2048 * 2 / 4.3e12 * 1e3
    assert two["ms_per_step"] == pytest.approx((one["ms_per_step"] - head) / 2 + head, rel=1e-3)


def test_summary_speedup_and_efficiency():
    tokens = {1: [[1, 2]] * 3, 2: [[1, 2], [1, 3], [1, 2]]}     # one request differs on 2 GPUs
    rows = [dict(context=1024, batch=64, arm=arm, size=size, repeat=i, decode_tokens_per_s=tok_s, ms_per_step=1.0,
                 density=None, roofline_tokens_per_s=2000.0, tokens=tokens[size])
            for arm, size, tok_s in (("dense", 1, 700.0), ("dense", 2, 1260.0)) for i in range(2)]
    by_size = {s["size"]: s for s in ts.summarize(rows)}
    assert by_size[2]["speedup"] == pytest.approx(1.8) and by_size[2]["efficiency"] == pytest.approx(0.9)
    assert by_size[1]["differ"] == 0 and by_size[2]["differ"] == 1


def test_one_arm_on_one_and_two_ranks_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = ts.main(["--preset", "test-tiny", "--dtype", "float32", "--device", "cpu", "--kernel", "reference",
                      "--shapes", "64x3", "--q-scale", "2", "--new-tokens", "4", "--warmup-tokens", "2",
                      "--repeats", "1", "--page-size", "32", "--arms", "wise", "--out", str(tmp_path)])
    assert [(r["size"], r["status"]) for r in report["rows"]] == [(1, "ok"), (2, "ok")]
    for r in report["rows"]:
        assert r["fallbacks"] == 0 and r["pages_returned"] and set(r["density"]) == {2, 3}
    two = next(s for s in report["summary"] if s["size"] == 2)
    assert two["differ"] == 0 and two["speedup"] > 0     # fp32 on CPU: the single-rank tokens
    assert "| 64 x 3 | wise | 2 |" in (tmp_path / "tp_scaling.md").read_text()
