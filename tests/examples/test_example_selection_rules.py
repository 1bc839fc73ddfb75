"""examples/selection_rules.py runs end to end (few steps here): train with wise_jax.train, then
decode held-out text densely, with WISE eta 0.95 and with top-k, and print the table; --rules
takes any built-in rule."""

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "examples" / "selection_rules.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("selection_rules_example", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_runs_and_reports_every_arm(example, capsys):
    rows = example.main(["--steps", "20", "--sequences", "3", "--context", "40", "--continuation", "8",
                         "--top-k", "1"])
    out = capsys.readouterr().out
    assert "trained 20 steps" in out and "bits/byte" in out
    assert [r["arm"] for r in rows] == ["dense", "wise eta=0.95", "wise top_k=1"]
    dense, eta, top_k = rows
    assert dense["density"] is None and dense["tokens_changed"] == 0.0
    assert 0 < eta["density"] <= 1 and 0 < top_k["density"] < 1  # one block of 5-6 per head: sparse
    for r in rows:
        # an untrained byte model costs about log2(258) = 8 bits a byte: 16 catches a broken sum
        assert 0 < r["bits_per_byte"] < 16 and 0 <= r["tokens_changed"] <= 1, r
        assert f"{r['bits_per_byte']:.4f}" in out


def test_example_rejects_bad_arguments(example, capsys):
    with pytest.raises(SystemExit):
        example.main(["--continuation", "0"])
    with pytest.raises(SystemExit):
        example.main(["--rules", "eta=0.9", "nearest=2"])
    assert "a selection rule is NAME=VALUE" in capsys.readouterr().err


def test_example_arms_take_any_rule(example):
    dense, eta, threshold = example.arms(8, ["eta=0.9", "threshold=0.05"])
    assert dense is None and eta.rule.describe() == "eta=0.9" and threshold.rule.describe() == "threshold=0.05"
