"""benchmarks/engine/jax_generate_bench.py on CPU: one arm end to end in its worker process (JSON, markdown,
PNG), and the arm grammar."""

import argparse
import json

import pytest


@pytest.fixture(scope="module")
def bench():
    from benchmarks.engine import jax_generate_bench
    return jax_generate_bench


def test_wise_arm_end_to_end(bench, tmp_path):
    bench.main(["--preset", "test-tiny", "--dtype", "float32", "--kernel", "reference", "--shapes", "64x3",
                "--new-tokens", "5", "--arms", "wise", "--q-scale", "4", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "jax_generate_bench.json").read_text())
    assert {"device", "jax", "python"} <= set(report["environment"])
    rows = report["rows"]
    assert [(r["arm"], r["repeat"], r["status"]) for r in rows] == [("wise", 0, "ok"), ("wise", 1, "ok")]
    for r in rows:
        assert r["decode_tokens"] == 3 * 4 and r["decode_steps"] == 4     # tokens after every first token
        assert r["recompiles"] == 0 and r["pages_returned"] and r["fallbacks"] == 0
        assert set(r["density"]) == {"2", "3"} and all(0 < d < 1 for d in r["density"].values())
    (summary,) = report["summary"]
    assert summary["arm"] == "wise" and summary["over_dense"] is None    # no dense arm in this run
    table = (tmp_path / "jax_generate_bench.md").read_text()
    assert "| 64 x 3 | 4 | wise | 1 |" in table
    assert (tmp_path / "jax_generate_bench.png").stat().st_size > 0


def test_arm_grammar(bench):
    assert bench.parse_arm("wise+stacked+unroll+nocb") == ("wise", ("stacked", "unroll", "nocb"))
    assert bench.parse_arm("dense+cublas+dsfusion") == ("dense", ("cublas", "dsfusion"))
    assert bench.dense_of("wise+unfused") == "dense+unfused" and bench.dense_of("old-wise") == "old"
    for bad in ("sparse", "dense+fast", "dense+stacked+unroll+unroll", "old+unroll", "dense+unroll"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_arm(bad)
