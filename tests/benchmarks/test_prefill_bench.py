"""benchmarks/engine/prefill_bench.py runs end to end at a tiny size on a CPU and reports what it measured."""

import json
import types

from benchmarks.engine import prefill_bench


def test_model_flops_by_hand():
    # One layer, one loop: matmul weights 2*(1+2)*2 (qkv) + 2*2 (o) + 3*2*3 (MLP) = 34, so
    # 2*34*3 = 204 over 3 tokens; attention 4*1*2 over 3*4/2 = 6 causal pairs = 48; head 2*2*5 = 20.
    config = types.SimpleNamespace(hidden_size=2, num_attention_heads=1, num_key_value_heads=1, head_dim=2,
                                   intermediate_size=3, num_hidden_layers=1, num_loops=1, vocab_size=5)
    assert prefill_bench.model_flops(config, 3, 1) == 272
    assert prefill_bench.model_flops(config, 3, 4) == 4 * 272


def test_prefill_bench_cpu_smoke(tmp_path):
    prefill_bench.main(["--preset", "test-tiny", "--dtype", "float32", "--device", "cpu", "--shapes", "40x2",
                        "--arms", "sdpa,reference,fa4", "--budgets", "24,whole", "--repeats", "1",
                        "--page-size", "32", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "prefill_bench.json").read_text())
    rows = {(r["arm"], r["budget"]): r for r in report["rows"]}
    assert len(rows) == 6
    for budget in (24, "whole"):
        for arm in ("sdpa", "reference"):
            r = rows[arm, budget]
            assert r["ran"] == arm and r["tokens_per_s"] > 0
            assert all(run["prompt_tokens"] == 80 for run in r["runs"])
        assert rows["reference", budget]["same"] == "2/2"      # the packed path's first tokens are SDPA's
        assert "CUDA device" in rows["fa4", budget]["error"]   # FA4 cannot run here: a row says why
    assert rows["sdpa", 24]["steps"] > rows["sdpa", "whole"]["steps"]   # 24-token chunks take more steps
    md = (tmp_path / "prefill_bench.md").read_text()
    assert "| 40 x 2 | reference | 24 | reference |" in md
    ratio = rows["sdpa", 24]["tokens_per_s"] / rows["sdpa", "whole"]["tokens_per_s"]
    assert f"| 40 x 2 | sdpa | 24 | {ratio:.3f} |" in md and "| 40 x 2 | fa4 | 24 |" not in md.split("Chunked")[1]
