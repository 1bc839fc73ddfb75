"""benchmarks/engine/compile_stalls.py on CPU: both engines, every measurement in its own process, at a
tiny size, and the report's fields (JSON and markdown)."""

import json

from benchmarks.engine import compile_stalls as cs


def test_both_engines_cold_warm_and_shrinking(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # torch's CPU steps on a busy 2-core machine (timings not checked)
    cs.main(["--preset", "test-tiny", "--dtype", "float32", "--context", "48", "--batch", "3",
             "--child-timeout", "120", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "compile_stalls.json").read_text())
    assert report["engines"] == ["jax", "torch"] and {"date", "args", "config"} <= set(report)
    assert {"device", "jax", "jaxlib"} <= set(report["environment"]["jax"])
    assert {"device", "torch", "triton"} <= set(report["environment"]["torch"])
    # torch on a CPU runs its reference kernels: no Triton kernel cached, so its warm start is its cold one
    statuses = {e: {m: r["status"] for m, r in report["results"][e].items()} for e in ("jax", "torch")}
    assert statuses == {"jax": dict.fromkeys(cs.MEASUREMENTS, "ok"),
                        "torch": dict(cold="ok", warm=cs.WARM_IS_COLD, shrinking="ok")}, report["results"]
    assert report["results"]["torch"]["cold"]["cache_files"] == 0
    for engine in ("jax", "torch"):
        results = report["results"][engine]
        for start in ("cold", "warm")[:2 if engine == "jax" else 1]:
            r = results[start]
            assert r["first_token_s"] == r["constructor_s"] + r["first_request_s"] > 0
            assert set(cs.PROGRAM_STATS) <= set(r) and r["cache_files"] >= 0
        shrinking = results["shrinking"]
        # 3 requests of 1, 2, 3 tokens: a prefill step, two decode steps (2 rows, then 1), one that reads the last
        assert [(s["launched"], s["running"], s["tokens_read"]) for s in shrinking["steps"]] == \
            [("prefill", 3, 0), ("decode", 2, 3), ("decode", 1, 2), (None, 0, 1)]
        summary = shrinking["summary"]
        assert summary["steps"] == 4 and summary["longest_s"] >= summary["median_s"] > 0
        assert set(shrinking["during"]) == set(cs.PROGRAM_STATS)
    # on a CPU: the JAX engine compiles on the step path (each new program a blocked step), torch runs eager
    assert report["results"]["jax"]["cold"]["background_compile"] is False
    assert report["results"]["jax"]["shrinking"]["summary"]["compile_stalls"] > 0
    assert report["results"]["torch"]["shrinking"]["summary"]["compile_stalls"] == 0
    standing = {(t["engine"], t["target"].split(":")[0]): t for t in report["standing"]}
    assert len(standing) == 6 and all(t["met"] is not None for t in standing.values())
    assert standing[("jax", "cold start")]["value"] == report["results"]["jax"]["cold"]["first_token_s"]
    assert standing[("torch", "warm start")]["value"] == report["results"]["torch"]["cold"]["first_token_s"]
    assert standing[("torch", "batch shrinking from 3 to 1")]["met"] is True
    text = (tmp_path / "compile_stalls.md").read_text()
    assert "| torch | batch shrinking from 3 to 1: no step stops for a compile | 0 steps (longest step" in text
    assert "| jax | cold |" in text and "| jax | warm |" in text and "no background compiles" in text
    assert "| torch | warm | " + "- | " * 11 + f"{cs.WARM_IS_COLD} |" in text
    assert "(its cold start: nothing was cached) |" in text


def test_report_of_processes_that_ran_out_of_time():
    """A cold process cut short after its first token keeps that token's time; one with nothing
    and a failed workload are targets not measured, each with its status."""
    timed_out = "timed out after 170 s"
    report = dict(date="2026-12-07T00:00:00", engines=["jax"], config={}, environment={},
                  args=dict(preset="ouro-1.4b", dtype="bfloat16", std=0.02, q_scale=[8.0], context=1024, batch=64),
                  results={"jax": dict(
                      cold=dict(engine="jax", status=timed_out + " (after its first token, waiting for the start-up "
                                "compiles)", first_token_s=41.5, constructor_s=1.5, first_request_s=40.0,
                                background_compile=True, cache_files=3),
                      warm=dict(engine="jax", status=timed_out, cache_files=3),
                      shrinking=dict(engine="jax", status="error: RuntimeError: boom"))})
    report["standing"] = cs.standing(report)
    assert [(t["value"], t["met"]) for t in report["standing"]] == [(41.5, True), (None, None), (None, None)]
    text = cs.markdown(report)
    assert "| jax | cold start: first token of a 1024-token prompt <= 60 s | 41.50 s | met |" in text
    assert f"| - s | not measured ({timed_out}) |" in text
    assert "| - steps | not measured (error: RuntimeError: boom) |" in text
    assert "no background compiles" not in text     # a GPU's run


def test_shrinking_summary_counts_the_steps_that_stopped():
    steps = [dict(seconds=s, launched=k, running=r, tokens_read=0)
             for s, k, r in ((1.0, "prefill", 3), (0.1, "decode", 2), (0.1, "decode", 1), (0.0, None, 0))]
    during = dict(compile_blocked_steps=1, step_programs=2)
    jax = cs.shrinking_summary(dict(engine="jax", steps=steps, during=during))
    assert jax == dict(steps=4, median_s=0.1, longest_s=1.0, longest_step=0, longest_launched="prefill",
                       longest_running=3, slow_steps=1, compile_stalls=1)
    assert cs.shrinking_summary(dict(engine="torch", steps=steps, during=during))["compile_stalls"] == 2   # graphs
