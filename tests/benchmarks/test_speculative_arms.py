"""The speculative arms of benchmarks/engine/throughput.py on CPU: their pure parts, and spec-wise,
spec-loops and spec-wise-sparse end to end (fresh worker processes) on a tiny model against the
dense arm."""

from __future__ import annotations

import types

import numpy as np
import pytest

from benchmarks.engine import speculative_arms as sa
from benchmarks.engine import throughput as tp


def test_flags_and_engine_arguments():
    parser = tp.build_parser()
    args = parser.parse_args(["--spec", "wise", "--spec", "loops", "--spec", "wise", "--num-draft", "3"])
    assert sa.arms_of(args) == ["spec-wise", "spec-loops"]
    for bad in (["--spec", "wise", "--num-draft", "0"], ["--spec", "wise", "--draft-loops", "2"]):
        with pytest.raises(SystemExit):
            sa.arms_of(parser.parse_args(bad))
    kw = sa.engine_kwargs("spec-loops", dict(num_draft=3, draft_loops=1, eta=0.9, kernel="reference"))
    assert kw["wise_config"] is None and (kw["speculative_config"].method, kw["speculative_config"].draft_loops) == (
        "loops", 1)
    kw = sa.engine_kwargs("spec-wise", dict(num_draft=5, eta=0.9, kernel="reference"))
    assert kw["wise_config"].eta == 0.9 and kw["speculative_config"].num_draft == 5
    assert not kw["speculative_config"].adaptive
    args = parser.parse_args(["--spec", "wise2", "--adaptive-draft", "--accept-rate", "0.9"])
    assert sa.arms_of(args) == ["spec-wise2@0.9"]
    kw = sa.engine_kwargs("spec-wise2@0.9", dict(num_draft=4, eta=0.9, kernel="reference", adaptive_draft=True))
    config, wise = kw["speculative_config"], kw["wise_config"]
    assert (config.method, config.draft_loops, config.adaptive) == ("wise", 2, True)
    assert (wise.discover_depths, wise.reuse_depths) == ((0,), (1,))
    assert config.verify_depth(4, wise) == 1 and config.draft_end(4) == 2
    args = parser.parse_args(["--spec", "wise-sparse", "--accept-rate", "0.8,0.9"])
    assert sa.arms_of(args) == ["spec-wise-sparse@0.8", "spec-wise-sparse@0.9"]
    assert sa.method_and_rate("spec-wise-sparse@0.9") == ("wise-sparse", 0.9)
    kw = sa.engine_kwargs("spec-wise-sparse", dict(num_draft=4, eta=0.9, kernel="reference"))
    config, wise = kw["speculative_config"], kw["wise_config"]
    assert (config.method, config.sparse_discovery, wise.eta) == ("wise", True, 0.9)
    assert config.verify_depth(4, wise) == 0 and config.draft_end(4) == 4


def test_cohort_counters_tokens_and_standing():
    stats = types.SimpleNamespace(spec_rounds=10, draft_tokens=40, accepted_tokens=30, decode_tokens=40)
    later = types.SimpleNamespace(spec_rounds=30, draft_tokens=120, accepted_tokens=60, decode_tokens=90)
    fields = sa.cohort_fields(sa.counters(stats), sa.counters(later))
    assert fields["acceptance_rate"] == 30 / 80 and fields["tokens_per_round"] == 50 / 20
    assert sa.compare_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == dict(
        requests=2, differ=1, first_difference={1: 1})
    with pytest.raises(ValueError, match="1 requests against the dense arm's 2"):
        sa.compare_tokens([[1], [2]], [[1]])
    summary = [dict(context=4096, batch=20, arm="spec-wise", over_dense=1.2, differ=0),
               dict(context=8192, batch=10, arm="spec-loops", over_dense=1.3, differ=2),
               dict(context=1024, batch=64, arm="spec-wise", over_dense=0.9, differ=0)]
    assert [(t["target"], t["shape"], t["met"]) for t in sa.standing(summary)] == [
        ("spec-wise / dense >= 1.15", "4096x20", True),
        ("spec-wise: requests whose tokens differ from dense", "4096x20", True),
        ("spec-loops / dense >= 1.15", "8192x10", True),
        ("spec-loops: requests whose tokens differ from dense", "8192x10", False),
        ("spec-wise: requests whose tokens differ from dense", "1024x64", True)]


def test_speculative_arms_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = tp.main(["--preset", "test-tiny", "--dtype", "float32", "--device", "cpu", "--kernel", "reference",
                      "--shapes", "64x3", "--q-scale", "2", "--new-tokens", "6", "--warmup-tokens", "2",
                      "--page-size", "32", "--arms", "dense", "--spec", "wise", "--spec", "loops",
                      "--spec", "wise-sparse", "--num-draft", "2", "--repeats", "1", "--out", str(tmp_path)])
    rows = {r["arm"]: r for r in report["rows"]}
    assert list(rows) == ["dense", "spec-wise", "spec-loops", "spec-wise-sparse"]
    for arm in ("spec-wise", "spec-loops", "spec-wise-sparse"):
        r = rows[arm]
        assert r["status"] == "ok" and r["pages_returned"] is True and r["decode_tokens"] == 3 * 5
        assert r["tokens"] == rows["dense"]["tokens"]                 # lossless: the dense arm's tokens
        assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["tokens_per_round"] <= 3
    summary = {s["arm"]: s for s in report["summary"]}
    assert summary["spec-wise"]["differ"] == summary["spec-loops"]["differ"] == summary["spec-wise-sparse"]["differ"] == 0
    text = (tmp_path / "throughput.md").read_text()
    assert "| 64 x 3 | spec-loops |" in text and "tok/round" in text


def test_set_acceptance_arms_flags_and_standing():
    parser = tp.build_parser()
    args = parser.parse_args(["--spec", "wise", "--spec", "loops", "--accept-rate", "0.706,0.971"])
    assert sa.arms_of(args) == ["spec-wise@0.706", "spec-wise@0.971", "spec-loops@0.706", "spec-loops@0.971"]
    for bad in (["--spec", "wise", "--accept-rate", "1.2"], ["--spec", "wise", "--accept-rate", "x"],
                ["--accept-rate", "0.9"]):
        with pytest.raises(SystemExit):
            sa.arms_of(parser.parse_args(bad))
    assert sa.method_and_rate("spec-wise@0.971") == ("wise", 0.971) and sa.method_and_rate("dense") is None
    kw = sa.engine_kwargs("spec-loops@0.706", dict(num_draft=3, eta=0.9, kernel="reference"))
    assert kw["speculative_config"].method == "loops" and kw["wise_config"] is None


def test_set_acceptance_is_checked_before_the_engine_is_touched():
    """set_acceptance (the engine's measurement hook, not a SpeculativeConfig field): a bad rate or
    seed, or an engine without speculation, is a ValueError naming it; a good one lands on the
    engine's Speculator."""
    import dataclasses
    import wise_torch
    assert "accept_rate" not in {f.name for f in dataclasses.fields(wise_torch.SpeculativeConfig)}
    engine = types.SimpleNamespace(speculator=types.SimpleNamespace(set_acceptance=None))
    for bad in (1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="a set acceptance must be a probability in"):
            sa.set_acceptance(engine, bad)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        sa.set_acceptance(engine, 0.5, seed=-1)
    with pytest.raises(ValueError, match="the engine has no speculative_config"):
        sa.set_acceptance(types.SimpleNamespace(speculator=None), 0.5)
    sa.set_acceptance(engine, 0.25, seed=3)
    rate, rng = engine.speculator.set_acceptance
    assert rate == 0.25 and rng.random() == np.random.default_rng(3).random()
    summary = [dict(context=4096, batch=20, arm="spec-wise@0.971", over_dense=1.2, differ=None),
               dict(context=1024, batch=1, arm="spec-wise@0.971", over_dense=1.2, differ=None),
               dict(context=8192, batch=10, arm="spec-loops@0.706", over_dense=1.05, differ=None),
               dict(context=4096, batch=20, arm="spec-wise@0.9", over_dense=1.0, differ=None)]
    assert [(t["target"], t["shape"], t["met"]) for t in sa.standing(summary)] == [
        ("spec-wise@0.971 / dense >= 1.15", "4096x20", True),
        ("spec-wise@0.971 / dense >= 1.30", "1024x1", False),
        ("spec-loops@0.706 / dense >= 1.10", "8192x10", False)]


def test_set_acceptance_arm_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = tp.main(["--preset", "test-tiny", "--dtype", "float32", "--device", "cpu", "--kernel", "reference",
                      "--shapes", "64x3", "--q-scale", "2", "--new-tokens", "9", "--warmup-tokens", "2",
                      "--page-size", "32", "--arms", "dense", "--spec", "wise", "--accept-rate", "1",
                      "--num-draft", "2", "--repeats", "1", "--out", str(tmp_path)])
    rows = {r["arm"]: r for r in report["rows"]}
    r = rows["spec-wise@1"]
    assert r["status"] == "ok" and r["pages_returned"] is True and r["decode_tokens"] == 3 * 8
    assert r["acceptance_rate"] == 1.0 and r["tokens_per_round"] > 2   # every draft accepted: 3 a round
    assert {s["arm"]: s for s in report["summary"]}["spec-wise@1"]["differ"] is None
    assert "timing only" in (tmp_path / "throughput.md").read_text()
