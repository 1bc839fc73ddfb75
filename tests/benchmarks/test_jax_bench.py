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
    assert bench.parse_arm("wise-adaptive+nocb") == ("wise-adaptive", ("nocb",)) and bench.dense_of("adaptive") == "dense"
    for bad in ("sparse", "dense+fast", "dense+stacked+unroll+unroll", "old+unroll", "dense+unroll"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_arm(bad)


def test_random_huginn_params_scale_the_queries_only(bench):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from wise_core.presets import PRESETS
    config = PRESETS["test-tiny-huginn"]
    h = config.num_attention_heads * config.head_dim
    one, three = (bench.random_huginn_params(config, 0, 0.02, s, jnp.float32) for s in (1.0, 3.0))
    for a, b in zip(one.core_block + one.coda, three.core_block + three.coda):   # qkv [hidden, 3 hidden]: q's columns first
        assert np.array_equal(np.asarray(b.qkv[:, :h]), np.asarray(a.qkv[:, :h] * 3))
        assert np.array_equal(np.asarray(b.qkv[:, h:]), np.asarray(a.qkv[:, h:]))
        assert np.array_equal(np.asarray(b.qkv_bias[:h]), np.asarray(a.qkv_bias[:h] * 3))
        assert np.array_equal(np.asarray(b.qkv_bias[h:]), np.asarray(a.qkv_bias[h:]))
        assert not np.asarray(a.qkv_bias[2 * h:]).any() and (np.asarray(a.norm_2) == 1).all()
    for a, b in zip(jax.tree.leaves((one.wte, one.adapter, one.prelude[0].fc)),
                    jax.tree.leaves((three.wte, three.adapter, three.prelude[0].fc))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(one.core_block[0].fc), np.asarray(one.core_block[1].fc))


def test_huginn_wise_arm_end_to_end(bench, tmp_path):
    """test-tiny-huginn at 3 core iterations: WISE reusing iteration 2, its roofline, no targets;
    Ouro's layout options refused."""
    from benchmarks.engine import timing
    from wise_core.presets import PRESETS
    report = bench.main(["--preset", "test-tiny-huginn", "--num-steps", "3", "--dtype", "float32", "--kernel",
                         "reference", "--shapes", "64x3", "--new-tokens", "3", "--warmup-tokens", "2", "--repeats", "1",
                         "--arms", "wise", "--q-scale", "2", "--out", str(tmp_path)])
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["decode_tokens"] == 3 * 2 and row["recompiles"] == 0
    assert row["pages_returned"] and row["fallbacks"] == 0
    assert set(row["density"]) == {2} and 0 < row["density"][2] <= 1
    roof = timing.roofline(PRESETS["test-tiny-huginn"], "float32", 64, 3, 3, row["density"], 4.3, 3)
    assert row["roofline_tokens_per_s"] == roof["tokens_per_s"]
    assert report["standing"] == [] and report["num_steps"] == 3
    assert "3 core iterations per token; WISE profile: discovery on depths 0, 1, reuse on 2, eta 0.95" in \
        (tmp_path / "jax_generate_bench.md").read_text()
    for arms in ("wise+stacked", "dense+tp2", "old"):
        with pytest.raises(SystemExit):
            bench.main(["--preset", "test-tiny-huginn", "--arms", arms, "--out", str(tmp_path)])


def test_huginn_adaptive_arm_end_to_end(bench, tmp_path):
    """test-tiny-huginn at 4 core iterations: the adaptive arm exits tokens early (KL < 0.01 on these
    random weights: a mean depth under 4), its roofline is dense's (every iteration runs), tok/s over
    dense and the requests whose tokens differ reported; refused on an Ouro model."""
    report = bench.main(["--preset", "test-tiny-huginn", "--num-steps", "4", "--dtype", "float32", "--kernel",
                         "reference", "--shapes", "64x3", "--new-tokens", "4", "--warmup-tokens", "2", "--repeats", "1",
                         "--page-size", "32", "--arms", "dense,adaptive", "--adaptive-threshold", "0.01",
                         "--q-scale", "2", "--out", str(tmp_path)])
    dense, adaptive = report["rows"]
    assert [(r["arm"], r["status"], r["recompiles"]) for r in (dense, adaptive)] == [("dense", "ok", 0),
                                                                                    ("adaptive", "ok", 0)]
    assert dense["mean_depth"] is None and 1 <= adaptive["mean_depth"] < 4
    assert adaptive["roofline_tokens_per_s"] == dense["roofline_tokens_per_s"]
    by_arm = {s["arm"]: s for s in report["summary"]}
    assert by_arm["adaptive"]["over_fixed"] == pytest.approx(adaptive["decode_tokens_per_s"]
                                                             / dense["decode_tokens_per_s"])
    assert by_arm["dense"]["over_fixed"] is None and by_arm["dense"]["differ"] == 0
    assert 0 <= by_arm["adaptive"]["differ"] <= 3
    text = (tmp_path / "jax_generate_bench.md").read_text()
    assert "adaptive depth: KL exit threshold 0.01, min_steps 0" in text
    assert f"| {adaptive['mean_depth']:.2f} | {by_arm['adaptive']['over_fixed']:.2f} |" in text
    with pytest.raises(SystemExit):
        bench.main(["--preset", "test-tiny", "--arms", "dense,wise-adaptive", "--out", str(tmp_path)])
